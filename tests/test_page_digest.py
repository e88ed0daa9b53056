"""Page digests and copy patterns: what changes a digest, and how a copy batch is named."""

from __future__ import annotations

import pytest
import torch

from batchgen.kv.copy_patterns import copy_patterns
from batchgen.kv.copy_runs import CopySplit
from batchgen.kv.page_checks import append_mismatches, expected_appends
from batchgen.kv.page_digest import check_digestible, layer_digests, page_digests

PAGE_SHAPE = (2, 2, 2, 4, 8)  # num_layers, K/V, num_kv_heads, page_size, head_dim


def make_pool(num_pages: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn((num_pages, *PAGE_SHAPE), generator=generator).to(dtype)


def test_digests_hold_one_value_per_page_and_layer_and_equal_pages_digest_equal():
    pool = make_pool()
    pool[4] = pool[1]
    digests = page_digests(pool, [1, 4, 2])
    assert digests.shape == (3, 2) and digests.dtype == torch.int64
    assert torch.equal(digests[0], digests[1])
    assert not torch.equal(digests[0], digests[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_changed_element_changes_only_its_layers_digest(dtype):
    pool = make_pool(dtype=dtype)
    before = page_digests(pool, [3])
    pool[3, 1, 0, 1, 2, 5] += 1  # page 3, layer 1, K, kv head 1, slot 2
    after = page_digests(pool, [3])
    assert after[0, 0] == before[0, 0] and after[0, 1] != before[0, 1]


def test_two_swapped_slots_change_the_digest():
    pool = make_pool()
    before = page_digests(pool, [2])
    pool[2, 0, 0, :, [0, 3]] = pool[2, 0, 0, :, [3, 0]]
    assert page_digests(pool, [2])[0, 0] != before[0, 0]


def test_digests_of_a_pool_match_digests_of_its_pages_gathered():
    pool = make_pool()
    assert torch.equal(page_digests(pool, [5, 0]), layer_digests(pool[[5, 0]]))
    assert page_digests(pool, []).shape == (0, 2)


def test_a_page_layer_of_no_whole_int32_words_is_refused():
    with pytest.raises(ValueError, match="page layer of 6 bytes cannot be digested"):
        check_digestible(torch.zeros((2, 1, 3), dtype=torch.float16))


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "patterns"),
    [
        ([4], [9], ["single"]),
        ([0, 1, 2], [5, 6, 7], ["consecutive"]),
        ([0, 1, 2], [7, 2, 5], ["scattered_dst"]),  # src a range, dst not
        ([0, 1, 2], [5, 6, 9], ["consecutive", "scattered_dst"]),  # 0->5, 1->6 one run; 2->9
        ([8, 3, 5], [0, 1, 2], ["scattered_src"]),  # dst a range, src not
        ([9, 2, 6], [4, 0, 7], ["shuffled"]),  # neither side a range
        ([2, 1, 0], [5, 6, 7], ["shuffled"]),  # both ranges, reversed
        ([0, 1, 9, 4], [3, 4, 0, 8], ["consecutive", "shuffled"]),  # a run among scattered pairs
    ],
    ids=[
        "single",
        "one_run",
        "src_range",
        "src_range_with_a_run",
        "dst_range",
        "both_scattered",
        "reversed",
        "mixed",
    ],
)
def test_a_copy_batch_is_named_by_its_shape(src_ids, dst_ids, patterns):
    shown = copy_patterns(
        "load", src_ids, dst_ids, page_bytes=64, host_to_host=True, split=CopySplit(2**20)
    )
    assert shown == [f"copy.load.{pattern}" for pattern in patterns]


@pytest.mark.parametrize(
    ("threads", "host_to_host", "split"),
    [(2, True, True), (1, True, False), (2, False, False)],
    ids=["two_threads", "one_thread", "gpu_involved"],
)
def test_a_batch_is_split_from_the_threshold_on_with_threads_between_host_pools(
    threads, host_to_host, split, monkeypatch
):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    at = copy_patterns(
        "store", [0, 1], [2, 3], page_bytes=64, host_to_host=host_to_host, split=CopySplit(128)
    )
    below = copy_patterns(
        "store", [0, 1], [2, 3], page_bytes=63, host_to_host=host_to_host, split=CopySplit(128)
    )
    assert ("copy.store.split" in at, "copy.store.split" in below) == (split, False)


def test_an_append_written_into_its_slots_matches_its_expected_digests_and_one_elsewhere_not():
    pool = make_pool()  # page_size 4
    kv = torch.randn((2, 2, 3, 2, 8))  # 3 positions from position 3: page 5 slot 3, page 1 0..1
    check = expected_appends(pool, [("a", [5, 1], 3, kv)])
    assert (check.uuids, check.page_ids.tolist()) == (("a", "a"), [5, 1])
    late = pool.clone()
    pool[5, :, :, :, 3], pool[1, :, :, :, 0:2] = kv[:, :, 0], kv[:, :, 1:3].transpose(2, 3)
    assert append_mismatches(pool, check) == []
    late[5, :, :, :, 3] = kv[:, :, 0]
    late[1, :, :, :, 1:3] = kv[:, :, 1:3].transpose(2, 3)  # one slot late on page 1
    assert [(m.position, m.layer) for m in append_mismatches(late, check)] == [(1, 0), (1, 1)]


def test_an_append_its_page_table_does_not_cover_is_left_to_the_write_to_refuse():
    check = expected_appends(make_pool(), [("a", [0], 2, torch.zeros((2, 2, 4, 2, 8)))])
    assert check.uuids == () and check.expected.shape == (0, 2)
