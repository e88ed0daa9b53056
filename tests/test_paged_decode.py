"""The in-place decode kernel computes what the padded SDPA batches compute, over float32 or
bfloat16 pages, reads nothing past a row's new token, and gives the same bits on any number of
threads."""

import os
import random
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

from batchgen.model.paged_attention import Span, plan_attention
from batchgen.model.paged_decode import InPlaceDecodes, attends_in_place
from batchgen.model.paged_decode_kernel import FASTMATH, exp_nonpositive


def nan_pages(num_pages: int, num_layers: int, num_kv_heads: int, page_size: int, head_dim: int):
    """Pages holding NaN in every slot, as unwritten memory may."""
    return torch.full((num_pages, num_layers, 2, num_kv_heads, page_size, head_dim), torch.nan)


def decode_case(
    num_heads, num_kv_heads, page_size, start_positions, num_layers=2, seed=0, head_dim=8
):
    """Decode spans on shuffled pages whose slots before each row's new token hold random K/V and
    every other slot NaN; queries and new K/V for them."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    tables_pages = [-(-(start + 1) // page_size) for start in start_positions]
    page_ids = list(range(sum(tables_pages) + 3))
    rng.shuffle(page_ids)
    pages = nan_pages(len(page_ids), num_layers, num_kv_heads, page_size, head_dim)
    spans, taken = [], 0
    for row, (start, num_pages) in enumerate(zip(start_positions, tables_pages)):
        table = page_ids[taken : taken + num_pages]
        taken += num_pages
        for position in range(start):
            slot = pages[table[position // page_size], :, :, :, position % page_size]
            slot.copy_(torch.randn(slot.shape, generator=generator))
        spans.append(Span(row, 1, start, table))
    num_rows = len(spans)
    q = torch.randn(num_rows, num_heads, head_dim, generator=generator)
    new_kv = torch.randn(2, num_rows, num_kv_heads, head_dim, generator=generator)
    return spans, pages, q, new_kv


def padded(spans, pages, q, new_kv, layer):
    out = torch.empty_like(q)
    for decodes in plan_attention(spans, pages, in_place=False).decodes:
        decodes.attend(q, new_kv, pages, layer, out)
    return out


def attended(decodes, q, new_kv, pages, layer):
    """Every packed row after ``decodes`` attended into a NaN-filled output."""
    out = torch.full(q.shape, torch.nan, dtype=q.dtype)
    decodes.attend(q, new_kv, pages, layer, out)
    return out


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, page_size, start_positions, head_dim",
    [
        (4, 4, 4, [1, 7, 30], 8),  # one query head per kv head
        (4, 2, 16, [3, 16, 17, 40], 8),  # two per kv head; a row exactly filling a page
        (8, 2, 1, [1, 2, 9], 8),  # four per kv head; one slot per page
        (2, 1, 5, [24], 8),  # one row
        (4, 2, 32, [2, 9, 70], 64),  # rows of four cache lines, keys asked for rows ahead
    ],
)
def test_in_place_attention_equals_the_padded_batches(
    num_heads, num_kv_heads, page_size, start_positions, head_dim
):
    spans, pages, q, new_kv = decode_case(
        num_heads, num_kv_heads, page_size, start_positions, head_dim=head_dim
    )
    (in_place,) = plan_attention(spans, pages).decodes
    assert isinstance(in_place, InPlaceDecodes)
    for layer in range(pages.shape[1]):
        out = attended(in_place, q, new_kv, pages, layer)
        # every row written; the NaN slots past each new token are never read
        assert not out.isnan().any()
        expected = padded(spans, pages, q, new_kv, layer)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_the_rows_given_are_the_rows_attended_and_the_only_rows_written():
    # packed rows 0 and 2 are decodes; row 1 is another sequence's prefill
    spans, pages, q, new_kv = decode_case(4, 2, 4, [5, 3, 9])
    decodes = [spans[0], Span(2, 1, spans[2].start_pos, spans[2].page_ids)]
    (in_place,) = plan_attention(decodes, pages).decodes
    both = attended(in_place, q, new_kv, pages, layer=1)
    assert both[1].isnan().all()
    for decode in decodes:
        (alone,) = plan_attention([decode], pages).decodes
        row = decode.row_start
        torch.testing.assert_close(both[row], attended(alone, q, new_kv, pages, layer=1)[row])


def test_rows_of_any_strides_are_read_in_place_with_the_same_bits():
    # the model's queries are a view of RoPE's output over q and k heads; its K/V a stack's halves
    spans, pages, q, new_kv = decode_case(4, 2, 4, [6, 11, 19])
    (in_place,) = plan_attention(spans, pages).decodes
    q_and_k = torch.cat((q, new_kv[0]), dim=1)
    strided_q = q_and_k[:, : q.shape[1]]
    assert not strided_q.is_contiguous()
    out = attended(in_place, strided_q, new_kv, pages, layer=0)
    assert torch.equal(out, attended(in_place, q, new_kv, pages, layer=0))


def test_bfloat16_queries_over_float32_pages_come_back_in_bfloat16():
    spans, pages, q, new_kv = decode_case(4, 2, 4, [6, 11])
    (in_place,) = plan_attention(spans, pages).decodes
    out = attended(in_place, q.bfloat16(), new_kv.bfloat16(), pages, layer=0)
    assert out.dtype == torch.bfloat16
    exact = attended(in_place, q.bfloat16().float(), new_kv.bfloat16().float(), pages, layer=0)
    assert torch.equal(out, exact.bfloat16())


def test_one_thread_and_two_give_the_same_bits():
    spans, pages, q, new_kv = decode_case(4, 2, 4, [6, 11, 19, 2])
    threads, outputs = torch.get_num_threads(), []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            (in_place,) = plan_attention(spans, pages).decodes  # the kernel takes torch's count
            assert numba.get_num_threads() == min(count, numba.config.NUMBA_NUM_THREADS)
            outputs.append(attended(in_place, q, new_kv, pages, layer=0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*outputs)


# a process set to one torch thread plans and attends a decode, numba started with two threads
ONE_THREAD_DECODE = """
import torch
torch.set_num_threads(1)
from batchgen.model.paged_attention import Span, plan_attention
pages = torch.zeros(2, 1, 2, 1, 4, 8)
(in_place,) = plan_attention([Span(0, 1, 3, [1])], pages).decodes
in_place.attend(torch.ones(1, 2, 8), torch.ones(2, 1, 1, 8), pages, 0, torch.empty(1, 2, 8))
print(torch.get_num_threads())
"""


def test_a_decode_leaves_torchs_thread_count_as_it_was():
    # numba's threads share torch's OpenMP runtime, and starting them once gave torch their count
    environment = dict(os.environ, NUMBA_NUM_THREADS="2")
    run = subprocess.run(
        [sys.executable, "-c", ONE_THREAD_DECODE],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.split() == ["1"]


def test_only_float32_and_bfloat16_pages_on_a_cpu_attend_in_place():
    assert attends_in_place(torch.zeros(1, 1, 2, 1, 4, 8))
    assert attends_in_place(torch.zeros(1, 1, 2, 1, 4, 8, dtype=torch.bfloat16))
    assert not attends_in_place(torch.zeros(1, 1, 2, 1, 4, 8, dtype=torch.float16))
    assert not attends_in_place(torch.zeros(1, 1, 2, 1, 4, 8, device="meta"))


@pytest.mark.parametrize("page_size, head_dim", [(4, 8), (32, 64)])
def test_bfloat16_pages_are_attended_in_place_as_float32_pages_of_their_values(page_size, head_dim):
    spans, pages, q, new_kv = decode_case(4, 2, page_size, [3, 16, 17, 40], head_dim=head_dim)
    halved = pages.bfloat16()  # NaN slots stay NaN, and are never read
    (in_place,) = plan_attention(spans, halved).decodes
    assert isinstance(in_place, InPlaceDecodes)
    for layer in range(pages.shape[1]):
        out = attended(in_place, q, new_kv, halved, layer)
        assert out.dtype == torch.float32 and not out.isnan().any()
        # the same sums as over float32 pages of the same values: each read widened exactly
        exact = attended(in_place, q, new_kv, halved.float(), layer)
        torch.testing.assert_close(out, exact, atol=1e-6, rtol=1e-5)
    rounded = attended(in_place, q.bfloat16(), new_kv.bfloat16(), halved, layer=0)
    assert rounded.dtype == torch.bfloat16


@numba.njit(fastmath=FASTMATH)  # as the kernel calls it
def exp_each(xs):
    out = np.empty_like(xs)
    for i in range(xs.shape[0]):
        out[i] = exp_nonpositive(xs[i])
    return out


def test_the_kernels_exp_is_within_a_relative_2_to_the_minus_23_where_float32_is_normal():
    xs = np.linspace(-87.33, 0, 200_001, dtype=np.float32)
    exact = np.exp(xs.astype(np.float64))
    assert (np.abs(exp_each(xs) - exact) / exact).max() < 2**-23


def test_the_kernels_exp_at_its_edges():
    xs = np.array([0.0, -0.0, -1e-30, -87.34, -100.0, -np.inf, np.nan], dtype=np.float32)
    got = exp_each(xs)
    assert got[:3].tolist() == [1.0, 1.0, 1.0]
    assert got[3:6].tolist() == [0.0, 0.0, 0.0]  # under float32's smallest normal
    assert np.isnan(got[6])
