"""Behaviour of batchgen.kv.page_copy: exact bytes, untouched neighbours, clear errors."""

from __future__ import annotations

import gc
import hashlib
import random
import threading
import time

import numpy as np
import pytest
import torch

from batchgen.kv import copy_patterns, copy_runs
from batchgen.kv.page_copy import AsyncCopyQueue, CopyError, copy_pages, new_page_tensor

PAGE_SHAPE = (2, 2, 2, 4, 8)  # num_layers, K/V, num_kv_heads, page_size, head_dim
NUM_PAGES = 32

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The "GPU" pool's device: a CPU tensor stands in for it everywhere; CUDA where there is one.
GPU_POOL_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


def make_pool(
    num_pages: int = NUM_PAGES,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    page_shape: tuple[int, ...] = PAGE_SHAPE,
) -> torch.Tensor:
    """A pool whose every page holds distinct random values."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_pages, *page_shape), generator=generator).to(dtype)


def reference_copy(
    src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]
) -> torch.Tensor:
    """What copy_pages must produce, one page at a time, on a clone of ``dst``."""
    expected = dst.clone()
    for src_id, dst_id in zip(src_ids, dst_ids):
        expected[dst_id] = src[src_id]
    return expected


def page_checksums(pool: torch.Tensor, page_ids: list[int]) -> list[str]:
    """SHA-256 of each page's bytes."""
    return [
        hashlib.sha256(pool[i].cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
        for i in page_ids
    ]


shuffled = list(range(NUM_PAGES))
random.Random(7).shuffle(shuffled)

ID_PATTERNS = {
    "consecutive": (list(range(4, 20)), list(range(10, 26))),
    "reversed": (list(range(15, -1, -1)), list(range(16, 32))),
    "shuffled": (shuffled[:20], shuffled[12:]),
    "mixed_runs": ([0, 1, 2, 3, 9, 10, 11, 30, 20, 21, 5], [8, 9, 10, 11, 0, 1, 2, 31, 17, 16, 29]),
    "consecutive_src_scattered_dst": (list(range(6)), [30, 2, 17, 5, 11, 0]),
    "scattered_src_consecutive_dst": ([30, 2, 17, 5, 11, 0], list(range(20, 26))),
    "one_src_page_to_many": ([3, 3, 3], [0, 1, 2]),
}


@pytest.mark.parametrize("pattern", ID_PATTERNS)
def test_copy_pages_moves_exact_bytes_and_leaves_other_pages_untouched(pattern):
    src_ids, dst_ids = ID_PATTERNS[pattern]
    src, dst = make_pool(seed=1), make_pool(seed=2)
    src_before = src.clone()
    expected = reference_copy(src, src_ids, dst, dst_ids)

    copy_pages(src, src_ids, dst, dst_ids)

    assert torch.equal(dst, expected)
    assert torch.equal(src, src_before)


@pytest.mark.parametrize("page_shape", [PAGE_SHAPE, (3, 7)], ids=["even_page", "odd_page"])
@pytest.mark.parametrize("threads", [1, 2, 3], ids=["one_thread", "two_threads", "three_threads"])
@pytest.mark.parametrize("pattern", ID_PATTERNS)
def test_host_copies_move_exact_bytes_on_any_number_of_threads(
    pattern, threads, page_shape, monkeypatch
):
    monkeypatch.setattr(copy_runs.torch, "get_num_threads", lambda: threads)
    src_ids, dst_ids = ID_PATTERNS[pattern]
    src, dst = make_pool(seed=1, page_shape=page_shape), make_pool(seed=2, page_shape=page_shape)
    expected = reference_copy(src, src_ids, dst, dst_ids)

    copy_pages(src, src_ids, dst, dst_ids, split=copy_runs.CopySplit(min_bytes=0))

    assert torch.equal(dst, expected)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "num_shares", "shares"),
    [
        # one run of 6 pages, cut in two equal halves
        (range(6), range(10, 16), 2, [[(0, 10, 3)], [(3, 13, 3)]]),
        # sorted by destination: 5->0, 6->1 is one run, 2->7 another; 3 pages in 2 shares
        ([2, 5, 6], [7, 0, 1], 2, [[(5, 0, 1)], [(6, 1, 1), (2, 7, 1)]]),
        # more shares than pages: the extra shares are empty
        ([4], [9], 3, [[], [], [(4, 9, 1)]]),
    ],
    ids=["one_run_halved", "runs_by_destination", "more_shares_than_pages"],
)
def test_host_copies_merge_runs_by_destination_and_share_pages_evenly(
    src_ids, dst_ids, num_shares, shares
):
    runs = copy_runs.pair_runs(np.array(src_ids), np.array(dst_ids))
    assert copy_runs._split_runs(*runs, num_shares) == shares


def test_host_runs_are_the_maximal_runs_of_a_batch_and_place_every_page_where_it_belongs():
    rng = np.random.default_rng(0)
    for _ in range(300):  # blocks of consecutive pairs, a few destinations swapped
        num_pages = int(rng.integers(2, 16))
        src_ids = rng.permutation(32)[:num_pages] if rng.random() < 0.3 else np.arange(num_pages)
        dst_ids = np.arange(num_pages) + int(rng.integers(0, 16))
        for _ in range(int(rng.integers(0, 3))):
            i, j = rng.integers(0, num_pages, 2)
            dst_ids[[i, j]] = dst_ids[[j, i]]
        src_starts, dst_starts, lengths = copy_runs.pair_runs(src_ids, dst_ids)
        placed = {
            int(d + k): int(s + k)
            for s, d, n in zip(src_starts, dst_starts, lengths)
            for k in range(n)
        }
        assert placed == dict(zip(dst_ids.tolist(), src_ids.tolist()))
        assert len(lengths) == copy_patterns._num_runs(src_ids, dst_ids)


def test_copy_pages_moves_bfloat16_bytes_exactly():
    src, dst = make_pool(dtype=torch.bfloat16, seed=1), make_pool(dtype=torch.bfloat16, seed=2)
    src_ids, dst_ids = ID_PATTERNS["mixed_runs"]
    expected = reference_copy(src, src_ids, dst, dst_ids)

    copy_pages(src, src_ids, dst, dst_ids)

    assert torch.equal(dst.view(torch.uint8), expected.view(torch.uint8))


def test_copy_pages_with_no_ids_changes_nothing():
    src, dst = make_pool(seed=1), make_pool(seed=2)
    dst_before = dst.clone()

    copy_pages(src, [], dst, [])

    assert torch.equal(dst, dst_before)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "message"),
    [
        ([0, 1, 2], [0, 1], "src_ids has 3 ids but dst_ids has 2"),
        ([0, 32, 1], [0, 1, 2], r"src_ids\[1\] = 32 is outside the pool's pages 0..31"),
        ([0, 1], [-1, 2], r"dst_ids\[0\] = -1 is outside the pool's pages 0..31"),
        ([0, 1, 2], [4, 5, 4], r"dst_ids\[2\] = 4 repeats a destination page"),
    ],
    ids=["length_mismatch", "src_id_past_the_pool", "negative_dst_id", "repeated_dst_id"],
)
def test_copy_pages_rejects_bad_ids_and_leaves_dst_untouched(src_ids, dst_ids, message):
    src, dst = make_pool(seed=1), make_pool(seed=2)
    dst_before = dst.clone()

    with pytest.raises(ValueError, match=message):
        copy_pages(src, src_ids, dst, dst_ids)

    assert torch.equal(dst, dst_before)


def test_copy_pages_rejects_pools_with_different_pages():
    with pytest.raises(ValueError, match="pages differ"):
        copy_pages(make_pool(), [0], make_pool(dtype=torch.bfloat16), [0])


def test_copy_pages_rejects_a_non_contiguous_pool():
    with pytest.raises(ValueError, match="pools must be contiguous"):
        copy_pages(make_pool(), [0], make_pool(2 * NUM_PAGES)[::2], [0])


def test_copy_pages_rejects_src_and_dst_sharing_memory():
    pool = make_pool()

    with pytest.raises(ValueError, match="src and dst share memory"):
        copy_pages(pool, [1], pool, [2])


def test_new_page_tensor_is_zeroed_with_requested_shape_and_dtype():
    pool = new_page_tensor((3, *PAGE_SHAPE), dtype=torch.bfloat16, device="cpu")

    assert pool.shape == (3, *PAGE_SHAPE)
    assert pool.dtype == torch.bfloat16
    assert not pool.any()


@pytest.mark.parametrize("device", GPU_POOL_DEVICES)
def test_copy_pages_async_ends_with_the_same_bytes_as_copy_pages(device):
    queue = AsyncCopyQueue()
    src_ids, dst_ids = ID_PATTERNS["mixed_runs"]
    src, dst = make_pool(seed=1).to(device), make_pool(seed=2)
    expected = reference_copy(src.cpu(), src_ids, dst, dst_ids)

    handle = queue.copy_pages_async(src, src_ids, dst, dst_ids)
    handle.wait()

    assert handle.done()
    assert handle.error is None
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("device", GPU_POOL_DEVICES)
def test_copy_pages_async_reports_a_failed_copy_as_copy_error_with_its_cause(device):
    queue = AsyncCopyQueue()
    src, dst = make_pool(seed=1).to(device), make_pool(seed=2)
    dst_before = dst.clone()

    handle = queue.copy_pages_async(src, [0, 99], dst, [0, 1])

    with pytest.raises(CopyError) as raised:
        handle.wait()
    assert handle.done()
    assert isinstance(raised.value.cause, ValueError)
    assert "src_ids[1] = 99" in str(raised.value.cause)
    assert raised.value.__cause__ is raised.value.cause
    assert handle.error is raised.value.cause
    assert torch.equal(dst, dst_before)


def test_copy_pages_async_runs_copies_in_issue_order():
    queue = AsyncCopyQueue()
    first, second, third = make_pool(seed=1), make_pool(seed=2), make_pool(seed=3)
    expected = third.clone()
    expected[4:8] = first[0:4]

    queue.copy_pages_async(first, range(4), second, range(10, 14))
    handle = queue.copy_pages_async(second, range(10, 14), third, range(4, 8))
    handle.wait()

    assert torch.equal(third, expected)


def test_queues_are_independent_a_stalled_queue_holds_back_only_its_own_copies():
    stalled, other = AsyncCopyQueue(), AsyncCopyQueue()
    release = threading.Event()
    blocker = stalled.submit(release.wait)
    src, dst = make_pool(seed=1), make_pool(seed=2)
    expected = reference_copy(src, [0, 1, 2], dst, [5, 6, 7])
    try:
        queued_behind = stalled.copy_pages_async(src, [2], dst, [7])
        independent = other.copy_pages_async(src, [0, 1], dst, [5, 6])
        deadline = time.monotonic() + 10
        while not independent.done() and time.monotonic() < deadline:
            time.sleep(0.005)

        assert independent.done()
        assert not queued_behind.done()
    finally:
        release.set()
    blocker.result()
    queued_behind.wait()
    assert torch.equal(dst, expected)


def test_a_queue_thread_ends_once_the_queue_is_garbage():
    before = set(threading.enumerate())
    queue = AsyncCopyQueue()
    queue.copy_pages_async(make_pool(seed=1), [0], make_pool(seed=2), [1]).wait()
    (thread,) = set(threading.enumerate()) - before

    del queue
    gc.collect()
    thread.join(timeout=10)

    assert not thread.is_alive()


def store_and_load(gpu_pool: torch.Tensor, host_pool: torch.Tensor) -> None:
    """Evict pages 3, 7, 8, 9 of ``gpu_pool`` to host, scribble on them, load them back
    elsewhere."""
    gpu_ids, host_ids, reload_ids = [3, 7, 8, 9], [10, 11, 12, 13], [20, 5, 6, 31]
    before = page_checksums(gpu_pool, gpu_ids)

    queue = AsyncCopyQueue()
    queue.copy_pages_async(gpu_pool, gpu_ids, host_pool, host_ids).wait()
    gpu_pool[gpu_ids] = 0
    queue.copy_pages_async(host_pool, host_ids, gpu_pool, reload_ids).wait()

    assert page_checksums(host_pool, host_ids) == before
    assert page_checksums(gpu_pool, reload_ids) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", GPU_POOL_DEVICES)
def test_round_trip_gpu_pool_to_host_and_back_preserves_page_bytes(device, dtype):
    gpu_pool = make_pool(dtype=dtype, seed=1).to(device)
    host_pool = new_page_tensor(
        (NUM_PAGES, *PAGE_SHAPE), dtype=dtype, device="cpu", pin_memory=device == "cuda"
    )

    store_and_load(gpu_pool, host_pool)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pattern", ID_PATTERNS)
def test_copy_pages_matches_reference_between_cuda_and_host(pattern, monkeypatch):
    monkeypatch.setattr(copy_runs, "MAX_RUN_BYTES", 3 * make_pool(1)[0].numel() * 4)
    src_ids, dst_ids = ID_PATTERNS[pattern]
    for src_device, dst_device in [("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")]:
        src, dst = make_pool(seed=1).to(src_device), make_pool(seed=2).to(dst_device)
        expected = reference_copy(src.cpu(), src_ids, dst.cpu(), dst_ids)

        copy_pages(src, src_ids, dst, dst_ids)

        assert torch.equal(dst.cpu(), expected), (src_device, dst_device)


# ---- the CUDA path's index arithmetic, run on CPU tensors ------------------------------------
# The runs between a GPU and the host (DMA, gather, scatter) and the chunks within one device are
# cut by index logic that does not care where the tensors live: issued on CPU tensors, it must
# move exactly the pages the reference copy moves.
@pytest.mark.parametrize("key_is_dst", [True, False], ids=["keyed_by_dst", "keyed_by_src"])
@pytest.mark.parametrize("max_run_pages", [1, 3, 64], ids=["runs_of_1", "runs_of_3", "uncut"])
@pytest.mark.parametrize("pattern", ID_PATTERNS)
def test_device_runs_move_exactly_the_reference_pages_on_cpu_tensors(
    pattern, max_run_pages, key_is_dst
):
    src_ids, dst_ids = ID_PATTERNS[pattern]
    src, dst = make_pool(seed=1), make_pool(seed=2)
    expected = reference_copy(src, src_ids, dst, dst_ids)
    runs = copy_runs._runs(
        np.array(src_ids), np.array(dst_ids), key_is_dst=key_is_dst, max_run_pages=max_run_pages
    )

    copy_runs._copy_runs(src, dst, *runs)

    assert torch.equal(dst, expected)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "key_is_dst", "max_run_pages", "expected"),
    [
        # keyed by src: 0,1,2 -> 7,8,9 one DMA, 5 -> 3 another
        (
            [0, 1, 2, 5],
            [7, 8, 9, 3],
            False,
            64,
            [(0, 3, 0, 7, True, True), (3, 4, 5, 3, True, True)],
        ),
        # keyed by dst 4,5,6: src 9,2,3 is a gather (src not consecutive)
        ([9, 2, 3], [4, 5, 6], True, 64, [(0, 3, 9, 4, False, True)]),
        # keyed by src 0,1,2: dst 6,1 is a scatter, and the run is cut at 2 pages
        ([0, 1, 2], [6, 1, 2], False, 2, [(0, 2, 0, 6, True, False), (2, 3, 2, 2, True, True)]),
    ],
    ids=["dma_runs", "gather", "scatter_cut_at_max_run_pages"],
)
def test_device_runs_are_cut_where_the_keyed_ids_stop_being_consecutive(
    src_ids, dst_ids, key_is_dst, max_run_pages, expected
):
    runs, sorted_src, sorted_dst = copy_runs._runs(
        np.array(src_ids), np.array(dst_ids), key_is_dst=key_is_dst, max_run_pages=max_run_pages
    )
    assert [tuple(run) for run in runs] == expected
    key = sorted_dst if key_is_dst else sorted_src
    assert key.tolist() == sorted(dst_ids if key_is_dst else src_ids)


@pytest.mark.parametrize("pattern", ID_PATTERNS)
def test_copies_within_one_device_chunk_the_pairs_and_move_the_reference_pages(
    pattern, monkeypatch
):
    monkeypatch.setattr(copy_runs, "MAX_RUN_BYTES", 3 * make_pool(1)[0].numel() * 4)
    src_ids, dst_ids = ID_PATTERNS[pattern]
    src, dst = make_pool(seed=1), make_pool(seed=2)
    expected = reference_copy(src, src_ids, dst, dst_ids)

    copy_runs._copy_within_device(src, torch.tensor(src_ids), dst, torch.tensor(dst_ids))

    assert torch.equal(dst, expected)
