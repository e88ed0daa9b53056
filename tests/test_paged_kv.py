"""Page layout: where each position lives, exact round-trips, and writes that touch nothing else."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.config import ModelConfig
from batchgen.model.paged_kv import (
    gather_kv,
    gather_pages,
    kv_page_shape,
    locate_slots,
    write_kv,
    write_kvs,
)

CONFIG = ModelConfig(
    vocab_size=16,
    hidden_size=8,
    intermediate_size=16,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    max_context=256,
)
SENTINEL = -7.0


def make_pages(page_size: int, num_pages: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(kv_page_shape(CONFIG, page_size, num_pages), SENTINEL, dtype=dtype)


def make_kv(num_tokens: int, offset: float = 0.0) -> torch.Tensor:
    """Distinct values everywhere: [num_layers, 2, num_tokens, kv_heads, head_dim]."""
    shape = (CONFIG.num_layers, 2, num_tokens, CONFIG.num_kv_heads, CONFIG.head_dim)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + offset


def test_page_shape_puts_the_page_outermost_and_the_slot_inside_the_kv_head():
    assert kv_page_shape(CONFIG, page_size=5, num_pages=11) == (11, 3, 2, 2, 5, 4)


def test_position_lives_in_page_table_entry_and_slot():
    pages = make_pages(page_size=5, num_pages=10)
    page_ids = [7, 2, 9]
    new_kv = make_kv(13)
    write_kv(pages, page_ids, 0, new_kv)
    for pos in range(13):
        page, slot = page_ids[pos // 5], pos % 5
        for layer in range(CONFIG.num_layers):
            assert torch.equal(pages[page, layer, 0, :, slot], new_kv[layer, 0, pos])
            assert torch.equal(pages[page, layer, 1, :, slot], new_kv[layer, 1, pos])


def test_write_then_gather_round_trips_across_page_boundaries():
    pages = make_pages(page_size=5, num_pages=10)
    page_ids = [4, 0, 8]
    new_kv = make_kv(13)
    write_kv(pages, page_ids, 0, new_kv)
    for layer in range(CONFIG.num_layers):
        k, v = gather_kv(pages, page_ids, 13, layer)
        assert k.shape == v.shape == (13, CONFIG.num_kv_heads, CONFIG.head_dim)
        assert torch.equal(k, new_kv[layer, 0])
        assert torch.equal(v, new_kv[layer, 1])


def test_append_at_start_pos_keeps_earlier_positions():
    pages = make_pages(page_size=5, num_pages=10)
    page_ids = [3, 6, 1]
    prefix, suffix = make_kv(7), make_kv(6, offset=10_000.0)
    write_kv(pages, page_ids, 0, prefix)
    write_kv(pages, page_ids, 7, suffix)
    k, v = gather_kv(pages, page_ids, 13, layer=2)
    assert torch.equal(k, torch.cat((prefix[2, 0], suffix[2, 0])))
    assert torch.equal(v, torch.cat((prefix[2, 1], suffix[2, 1])))


def test_write_touches_no_other_slot():
    pages = make_pages(page_size=5, num_pages=6)
    # positions 3..6: page 5 slots 3,4; page 2 slots 0,1
    write_kv(pages, [5, 2], start_pos=3, new_kv=make_kv(4))
    written = torch.zeros(6, 5, dtype=torch.bool)
    written[5, 3:5] = True
    written[2, 0:2] = True
    untouched = pages.permute(0, 4, 1, 2, 3, 5)[~written]  # [page, slot, ...] masked
    assert torch.all(untouched == SENTINEL)
    assert not torch.any(pages.permute(0, 4, 1, 2, 3, 5)[written] == SENTINEL)


def test_gather_does_not_modify_pages():
    pages = make_pages(page_size=4, num_pages=5)
    write_kv(pages, [1, 3], 0, make_kv(6))
    before = pages.clone()
    k, _ = gather_kv(pages, [1, 3], 6, layer=0)
    k.fill_(0.0)
    assert torch.equal(pages, before)


def test_write_converts_to_the_page_dtype():
    pages = make_pages(page_size=4, num_pages=2, dtype=torch.bfloat16)
    new_kv = torch.randn(CONFIG.num_layers, 2, 3, CONFIG.num_kv_heads, CONFIG.head_dim)
    write_kv(pages, [1], 0, new_kv)
    k, v = gather_kv(pages, [1], 3, layer=1)
    assert k.dtype == torch.bfloat16
    assert torch.equal(k, new_kv[1, 0].bfloat16())
    assert torch.equal(v, new_kv[1, 1].bfloat16())


def test_page_table_too_short_is_rejected():
    pages = make_pages(page_size=5, num_pages=4)
    with pytest.raises(
        ValueError, match="page table of 2 pages covers 10 positions; 11 positions need 3 pages"
    ):
        write_kv(pages, [0, 1], 5, make_kv(6))
    with pytest.raises(ValueError, match="11 positions need 3 pages"):
        gather_kv(pages, [0, 1], 11, layer=0)


def test_locate_slots_handles_a_batch_of_page_tables():
    page_tables = torch.tensor([[4, 2, 0], [1, 3, 5]])
    positions = torch.tensor([[0, 4, 9], [3, 8, 11]])
    slots = locate_slots(page_tables, positions, page_size=4)
    assert slots.page_index.tolist() == [[4, 2, 0], [1, 5, 5]]
    assert slots.slot_index.tolist() == [[0, 0, 1], [3, 0, 3]]


@settings(max_examples=40, deadline=None)
@given(
    page_size=st.integers(1, 9),
    start_pos=st.integers(0, 20),
    num_new=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_any_write_reads_back_exactly_and_leaves_the_rest(page_size, start_pos, num_new, seed):
    num_positions = start_pos + num_new
    num_table_pages = -(-num_positions // page_size)
    num_pages = num_table_pages + 3
    page_ids = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))[
        :num_table_pages
    ].tolist()
    pages = make_pages(page_size, num_pages)
    new_kv = make_kv(num_new, offset=1.0)
    write_kv(pages, page_ids, start_pos, new_kv)
    for layer in range(CONFIG.num_layers):
        k, v = gather_kv(pages, page_ids, num_positions, layer)
        assert torch.equal(k[start_pos:], new_kv[layer, 0])
        assert torch.equal(v[start_pos:], new_kv[layer, 1])
        assert torch.all(k[:start_pos] == SENTINEL) and torch.all(v[:start_pos] == SENTINEL)
    assert int((pages != SENTINEL).sum()) == new_kv.numel()


def test_writes_in_one_call_equal_the_same_writes_one_by_one():
    one_by_one, batched = (
        make_pages(page_size=4, num_pages=12),
        make_pages(page_size=4, num_pages=12),
    )
    writes = [
        ([7, 2], 0, make_kv(6)),  # a prefill across a page boundary
        ([5, 0, 9], 9, make_kv(1, offset=1_000.0)),  # a decode in its third page
        ([3, 11, 1], 2, make_kv(7, offset=2_000.0)),  # an extend from the middle of a page
    ]
    for page_ids, start_pos, new_kv in writes:
        write_kv(one_by_one, page_ids, start_pos, new_kv)

    write_kvs(batched, writes)

    assert torch.equal(batched, one_by_one)
    assert int((batched != SENTINEL).sum()) == sum(kv.numel() for _, _, kv in writes)


def test_gather_pages_reads_whole_pages_in_table_order():
    pages = make_pages(page_size=4, num_pages=6)
    write_kv(pages, [4, 1], 0, make_kv(6))

    k, v = gather_pages(pages, torch.tensor([1, 4]), layer=2)

    assert k.shape == v.shape == (8, CONFIG.num_kv_heads, CONFIG.head_dim)
    assert torch.equal(k[:2], make_kv(6)[2, 0, 4:]) and torch.equal(k[4:], make_kv(6)[2, 0, :4])
    assert torch.equal(v[:2], make_kv(6)[2, 1, 4:]) and torch.all(v[2:4] == SENTINEL)


def test_float32_pages_on_a_cpu_take_the_same_bytes_as_the_indexed_write():
    # float32 pages are written by kv_write_kernel, float64 ones by torch's indexed assignment
    writes = [
        ([7, 2], 0, make_kv(6)),
        ([5, 0, 9], 9, make_kv(1, offset=1_000.0)),
        ([3, 11, 1], 2, make_kv(7, offset=2_000.0)),
    ]
    by_kernel = make_pages(page_size=4, num_pages=12)
    by_index = make_pages(page_size=4, num_pages=12, dtype=torch.float64)
    write_kvs(by_kernel, writes)
    write_kvs(by_index, writes)
    assert torch.equal(by_kernel.double(), by_index)


def test_bfloat16_pages_on_a_cpu_take_the_same_bytes_as_the_indexed_write():
    # bfloat16 pages are written by kv_write_kernel as their bits, float16 ones by torch's index
    writes = [([7, 2], 0, make_kv(6)), ([3, 11, 1], 2, make_kv(7, offset=0.5))]
    by_kernel = make_pages(page_size=4, num_pages=12, dtype=torch.bfloat16)
    by_index = make_pages(page_size=4, num_pages=12, dtype=torch.float32)
    write_kvs(by_kernel, writes)
    write_kvs(by_index, [(ids, start, kv.bfloat16().float()) for ids, start, kv in writes])
    assert torch.equal(by_kernel.float(), by_index.bfloat16().float())


def test_the_kernel_converts_other_dtypes_to_the_float32_pages():
    pages = make_pages(page_size=4, num_pages=3)
    new_kv = torch.randn(CONFIG.num_layers, 2, 5, CONFIG.num_kv_heads, CONFIG.head_dim)
    write_kv(pages, [2, 0], 1, new_kv.bfloat16())
    k, v = gather_kv(pages, [2, 0], 6, layer=2)
    assert torch.equal(k[1:], new_kv[2, 0].bfloat16().float())
    assert torch.equal(v[1:], new_kv[2, 1].bfloat16().float())
    assert torch.all(k[0] == SENTINEL)
