"""Attention over KV pages: the per-forward plan and one attention per kind of sequence.

A forward's sequences are packed rows (``Span``); the plan sorts them by kind once
and every layer attends with it:

    kind     | start_pos | new tokens | attention
    ---------+-----------+------------+------------------------------------------------
    prefill  | 0         | n >= 1     | SDPA with is_causal over its own tokens
    decode   | > 0       | 1          | on CPU in float32: a kernel reading the pages in place
             |           |            | (``paged_decode``); else padded, masked SDPA per batch
             |           |            | of similar lengths
    extend   | > 0       | n > 1      | SDPA over cached + new K/V with an explicit mask

Everything here reads ``kv_pages`` and never writes it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from batchgen.config import pages_needed
from batchgen.model.paged_decode import InPlaceDecodes, attends_in_place
from batchgen.model.paged_kv import (
    block_rows,
    gather_blocks,
    gather_kv,
    page_size_of,
    page_table_tensor,
)

# One more decode batch (its own gather and SDPA calls in every layer) costs about what gathering
# and attending this much more K/V of a layer does (`scripts/bench.py decode-attention`, on CPU).
DECODE_BATCH_COST_BYTES = 512 * 1024
MAX_DECODE_BATCHES = 8


@dataclass(frozen=True, slots=True)
class Span:
    """One sequence's rows ``[row_start, row_start + num_new)`` of the packed batch."""

    row_start: int
    num_new: int
    start_pos: int
    page_ids: Sequence[int]

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_start + self.num_new)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """One-token sequences with a cached history, attended as one padded batch of B rows.

    Every row reads its page table padded to the longest row's, P pages, whole: T = P * page_size
    key columns, so its key column t is position t::

        columns of row b      | keys and values
        ----------------------+----------------------------------------------------
        [0, start_pos)        | cached, read from its pages
        start_pos             | its new token's, from this forward
        (start_pos, T)        | zeros, masked

    The padding is zeroed after each gather: an unwritten slot may hold anything, NaN included,
    and a NaN key or value survives the masking of its score.
    """

    rows: Tensor  # [B] packed row of each decode token
    key_blocks: Tensor  # [layers, 2, B, kv_heads, P] where each page of keys is (block_rows)
    # rows of head_dim of the gathered [2, B, kv_heads, T, head_dim]: each new token's K and V
    # in (kv, row, kv head) order, and every padding column's
    new_key_rows: Tensor
    pad_key_rows: Tensor
    key_mask: Tensor  # [B, 1, 1, T] 0 where a key may be attended, -inf where not
    # the gathered K/V of one layer, reused by every layer: a fresh buffer of several MiB per
    # layer costs its page faults each time (glibc maps a large allocation anew)
    scratch: Tensor

    def attend(self, q: Tensor, new_kv: Tensor, kv_pages: Tensor, layer: int, out: Tensor) -> None:
        """The batch's attention (``attend_decodes``) written into its rows of ``out``; reads
        ``kv_pages``."""
        out[self.rows] = attend_decodes(q, new_kv, self, kv_pages, layer)


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How each layer attends; built once per forward, shared by every layer."""

    prefills: tuple[Span, ...]
    extends: tuple[Span, ...]
    # the decodes: one in-place batch, or padded batches of similar table lengths
    decodes: tuple[DecodeBatch | InPlaceDecodes, ...]


def attend_sequence(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None) -> Tensor:
    """One sequence: q [n, heads, d] over k, v [S, kv_heads, d]; causal when ``key_mask`` [n, S] is
    None. Kv head j serves query heads j*g .. j*g+g-1 (HF ``repeat_kv``), without copying K/V per
    head; 4-d inputs take the fused SDPA kernel (3-d ones fall back to the unfused one on CPU)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=key_mask,
        is_causal=key_mask is None,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def attend_extend(
    q: Tensor, k: Tensor, v: Tensor, span: Span, kv_pages: Tensor, layer: int
) -> Tensor:
    """A sequence with cached history and several new tokens: new token i sees keys
    0..start_pos+i."""
    cached_k, cached_v = gather_kv(kv_pages, span.page_ids, span.start_pos, layer)
    keys = torch.cat((cached_k.to(k.dtype), k[span.rows]))
    values = torch.cat((cached_v.to(v.dtype), v[span.rows]))
    query_pos = span.start_pos + torch.arange(span.num_new, device=q.device)
    key_mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= query_pos[:, None]
    return attend_sequence(q[span.rows], keys, values, key_mask)


def attend_decodes(
    q: Tensor, new_kv: Tensor, decodes: DecodeBatch, kv_pages: Tensor, layer: int
) -> Tensor:
    """All decode tokens of a batch in one SDPA over their keys gathered per kv head, with this
    forward's ``new_kv`` [2, N, kv_heads, d] in their own columns; each row's query heads are
    folded under their kv head, so no K/V copy per head."""
    num_batch = len(decodes.rows)
    # [2, B, kv_heads, T, d]
    keys_values = gather_blocks(kv_pages, decodes.key_blocks[layer], decodes.scratch)
    num_kv_heads, head_dim = keys_values.shape[2], keys_values.shape[4]
    key_rows = keys_values.view(-1, head_dim)
    key_rows.index_fill_(0, decodes.pad_key_rows, 0)
    new_keys_values = new_kv[:, decodes.rows].reshape(-1, head_dim)  # [2 * B * kv_heads, d]
    key_rows.index_copy_(0, decodes.new_key_rows, new_keys_values.to(key_rows.dtype))
    keys_values = keys_values.to(q.dtype)
    grouped_q = q[decodes.rows].view(num_batch, num_kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(
        grouped_q, keys_values[0], keys_values[1], attn_mask=decodes.key_mask.to(q.dtype)
    )
    return out.reshape(num_batch, -1, head_dim)


def plan_attention(
    spans: list[Span],
    kv_pages: Tensor,
    max_decode_batches: int | None = None,
    in_place: bool | None = None,
) -> AttentionPlan:
    """The spans by kind for attending ``kv_pages``: the decodes as one in-place batch where
    ``in_place`` (default: ``attends_in_place``), else in at most ``max_decode_batches`` padded
    batches (``decode_groups``; default: the device's). Pure but for numba's thread count, set
    for an in-place batch (``_plan_in_place``)."""
    page_size, device = page_size_of(kv_pages), kv_pages.device
    decode_spans = [s for s in spans if s.start_pos > 0 and s.num_new == 1]
    prefills = tuple(s for s in spans if s.start_pos == 0)
    extends = tuple(s for s in spans if s.start_pos > 0 and s.num_new > 1)
    if in_place is None:
        in_place = attends_in_place(kv_pages)
    if decode_spans and in_place:
        return AttentionPlan(prefills, extends, (_plan_in_place(decode_spans, kv_pages),))
    max_batches = max_decode_batches or default_decode_batches(device)
    layer_page_bytes = math.prod(kv_pages.shape[2:]) * kv_pages.element_size()  # its K and V
    cost_pages = -(-DECODE_BATCH_COST_BYTES // layer_page_bytes)
    table_lengths = [_pages_read(s, page_size) for s in decode_spans]
    groups = decode_groups(table_lengths, max_batches, cost_pages)
    return AttentionPlan(
        prefills,
        extends,
        decodes=tuple(
            _plan_decodes([decode_spans[i] for i in group], kv_pages) for group in groups
        ),
    )


def _pages_read(decode: Span, page_size: int) -> int:
    """Pages of its table a decode reads: those up to its new token's. Pure."""
    return pages_needed(decode.start_pos + 1, page_size)


def default_decode_batches(device: torch.device) -> int:
    """On CUDA one padded batch: every further one costs its own kernel launches in every layer."""
    return 1 if device.type == "cuda" else MAX_DECODE_BATCHES


def decode_groups(num_pages: Sequence[int], max_batches: int, cost_pages: int) -> list[list[int]]:
    """The decode rows (indices into ``num_pages``, each row's table length) as padded batches.

    Every row of a batch is padded to the batch's longest table, so a batch of rows of unequal
    lengths gathers and attends pages it throws away, into a buffer per layer of rows x the longest
    table. Rows are sorted longest first; a batch is cut in two where that saves the most padded
    pages, while it saves more than ``cost_pages`` (what one more batch's own gather and SDPA
    calls cost, in pages), into at most ``max_batches`` batches. Pure.
    """
    order = sorted(range(len(num_pages)), key=lambda row: num_pages[row], reverse=True)
    lengths = [num_pages[i] for i in order]
    bounds = [0, len(order)]  # batch b is order[bounds[b]:bounds[b + 1]]
    while len(bounds) - 1 < max_batches:
        saved, cut = max(_best_cut(lengths, start, end) for start, end in zip(bounds, bounds[1:]))
        if saved <= cost_pages:
            break
        bisect.insort(bounds, cut)
    return [order[start:end] for start, end in zip(bounds, bounds[1:]) if end > start]


def _best_cut(lengths: Sequence[int], start: int, end: int) -> tuple[int, int]:
    """(padded pages saved, index) of the best cut of the batch ``lengths[start:end]`` (longest
    first): rows from the cut on are padded to their own longest instead of ``lengths[start]``.
    Pure."""
    if end - start < 2:
        return 0, start
    return max(
        ((end - cut) * (lengths[start] - lengths[cut]), cut) for cut in range(start + 1, end)
    )


def _padded_tables(spans: list[Span], page_size: int) -> list[list[int]]:
    """Each decode's page table cut to the pages it reads, padded with its first page to the
    longest. Pure."""
    tables = [s.page_ids[: _pages_read(s, page_size)] for s in spans]
    pages_per_row = max(map(len, tables))
    return [[*table, *[table[0]] * (pages_per_row - len(table))] for table in tables]


def _plan_in_place(spans: list[Span], kv_pages: Tensor) -> InPlaceDecodes:
    """The decode spans as one batch for the in-place kernel (see ``InPlaceDecodes``), whose calls
    in this forward run on torch's thread count: sets numba's, once a forward, not once a layer."""
    from batchgen.model.paged_decode_kernel import use_threads  # numba loads where it decodes

    use_threads(torch.get_num_threads())
    return InPlaceDecodes(
        rows=np.array([s.row_start for s in spans], dtype=np.int64),
        page_tables=np.array(_padded_tables(spans, page_size_of(kv_pages)), dtype=np.int64),
        num_cached=np.array([s.start_pos for s in spans], dtype=np.int64),
    )


def _plan_decodes(spans: list[Span], kv_pages: Tensor) -> DecodeBatch:
    """The padded batch of the decode spans (see ``DecodeBatch``). Pure."""
    page_size, device = page_size_of(kv_pages), kv_pages.device
    padded = _padded_tables(spans, page_size)
    pages_per_row = len(padded[0])
    start_pos = torch.tensor([s.start_pos for s in spans], device=device)
    columns = torch.arange(pages_per_row * page_size, device=device)[None, :]  # [1, T]
    padding = columns > start_pos[:, None]
    key_mask = torch.zeros(padding.shape, dtype=kv_pages.dtype, device=device)
    key_mask.masked_fill_(padding, -torch.inf)
    key_blocks = block_rows(kv_pages, page_table_tensor(padded, device))
    num_rows, num_kv_heads = len(spans), kv_pages.shape[3]
    # the first key row of each (kv, row, kv head) matrix of the gathered K/V
    firsts = torch.arange(2 * num_rows * num_kv_heads, device=device).view(2, num_rows, -1)
    firsts = firsts * columns.shape[1]
    pad_rows, pad_columns = torch.nonzero(padding, as_tuple=True)
    return DecodeBatch(
        rows=torch.tensor([s.row_start for s in spans], device=device),
        key_blocks=key_blocks,
        new_key_rows=(firsts + start_pos[None, :, None]).view(-1),
        pad_key_rows=(firsts[:, pad_rows] + pad_columns[None, :, None]).view(-1),
        key_mask=key_mask[:, None, None, :],
        scratch=kv_pages.new_empty(key_blocks[0].numel() * page_size * kv_pages.shape[5]),
    )
