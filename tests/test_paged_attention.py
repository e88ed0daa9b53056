"""How decode rows are batched for attention: one in-place batch for float32 pages on a CPU;
elsewhere padded batches (``decode_groups``), and the cost ``plan_attention`` gives them."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from batchgen.model import paged_attention
from batchgen.model.paged_attention import DecodeBatch, Span, decode_groups, plan_attention
from batchgen.model.paged_decode import InPlaceDecodes

COST = 16  # pages a cut must save


def test_rows_of_equal_length_make_one_batch():
    assert decode_groups([4, 4, 4], max_batches=8, cost_pages=COST) == [[0, 1, 2]]


def test_no_rows_make_no_batch():
    assert decode_groups([], max_batches=8, cost_pages=COST) == []


def test_a_cut_that_saves_more_padded_pages_than_a_batch_costs_is_made():
    # two rows of 2 pages padded to 30 waste 56 pages
    assert decode_groups([2, 30, 2, 30], max_batches=8, cost_pages=COST) == [[1, 3], [0, 2]]


def test_a_cut_that_saves_no_more_than_a_batch_costs_is_not_made():
    assert decode_groups([COST + 1, 1], max_batches=8, cost_pages=COST) == [[0, 1]]
    assert decode_groups([COST + 2, 1], max_batches=8, cost_pages=COST) == [[0], [1]]


def test_the_cut_saving_most_comes_first():
    # cutting before the 10s saves 5 x 20 = 100 pages, before the 1s 2 x 29 = 58; then
    # cutting the second batch before its 1s saves 2 x 9 = 18
    lengths = [30, 10, 10, 10, 1, 1]
    assert decode_groups(lengths, max_batches=2, cost_pages=COST) == [[0], [1, 2, 3, 4, 5]]
    assert decode_groups(lengths, max_batches=3, cost_pages=COST) == [[0], [1, 2, 3], [4, 5]]


def test_one_batch_when_only_one_is_allowed():
    assert decode_groups([2, 30, 2, 30], max_batches=1, cost_pages=COST) == [[1, 3, 0, 2]]


@given(st.lists(st.integers(1, 64), max_size=40), st.integers(1, 8), st.integers(0, 64))
def test_every_row_is_in_one_batch_longest_first_within_the_cap(num_pages, max_batches, cost):
    groups = decode_groups(num_pages, max_batches, cost)

    assert sorted(row for group in groups for row in group) == list(range(len(num_pages)))
    assert len(groups) <= max_batches and all(groups)
    flat = [num_pages[row] for group in groups for row in group]
    assert flat == sorted(num_pages, reverse=True)


def test_float32_pages_on_a_cpu_attend_every_decode_in_one_in_place_batch():
    spans = [Span(0, 1, 16 * 30, list(range(31))), Span(1, 5, 0, [31]), Span(6, 1, 5, [32])]
    (in_place,) = plan_attention(spans, torch.zeros(40, 1, 2, 2, 16, 8)).decodes
    assert isinstance(in_place, InPlaceDecodes)
    assert in_place.rows.tolist() == [0, 6]
    assert in_place.num_cached.tolist() == [480, 5]
    # tables cut to the pages read (up to the new token's), then padded with each one's first
    assert in_place.page_tables.tolist() == [list(range(31)), [32] * 31]
    (padded,) = plan_attention(spans, torch.zeros(40, 1, 2, 2, 16, 8, dtype=torch.float16)).decodes
    assert isinstance(padded, DecodeBatch)


def test_the_batch_cost_is_counted_in_pages_of_the_pool_attended(monkeypatch):
    # K and V x 16 tokens x 2 kv heads x 8 dims, float32: 2 KiB per page of a layer
    pages = torch.zeros(40, 1, 2, 2, 16, 8)
    spans = [Span(0, 1, 16 * 30, list(range(31))), Span(1, 1, 5, [31]), Span(2, 1, 5, [32])]
    monkeypatch.setattr(paged_attention, "DECODE_BATCH_COST_BYTES", 2048 * 60)
    # the cut saves 2 x 30 pages: not more
    assert len(plan_attention(spans, pages, in_place=False).decodes) == 1
    monkeypatch.setattr(paged_attention, "DECODE_BATCH_COST_BYTES", 2048 * 59)
    assert len(plan_attention(spans, pages, in_place=False).decodes) == 2
    assert len(plan_attention(spans, pages, max_decode_batches=1, in_place=False).decodes) == 1
