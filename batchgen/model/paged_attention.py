"""Attention over KV pages: the per-forward plan and one attention per kind of sequence.

A forward's sequences are packed rows (``Span``); the plan sorts them by kind once
and every layer attends with it:

    kind     | start_pos | new tokens | attention
    ---------+-----------+------------+------------------------------------------------
    prefill  | 0         | n >= 1     | SDPA with is_causal over its own tokens
    decode   | > 0       | 1          | padded, masked SDPA per batch of similar lengths
    extend   | > 0       | n > 1      | SDPA over cached + new K/V with an explicit mask

Everything here reads ``kv_pages`` and never writes it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from batchgen.config import pages_needed
from batchgen.model.paged_kv import gather_kv, gather_pages, page_table_tensor

# One more decode batch (its own gather and SDPA calls in every layer) costs about what gathering
# and attending this much more K/V of a layer does (scripts/bench_decode_attention.py, on CPU).
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

    Row b reads its whole pages up to its new token's, padded to the longest such table with its
    first page, so its key column t is position t (T = pages per row x page size)::

        columns of row b               | keys and values
        -------------------------------+--------------------------------------------------
        [0, start_pos)                 | cached, read from its pages
        start_pos                      | its new token's, from this forward
        (start_pos, end of its pages)  | zeroed: unwritten slots, which may hold anything
        padding                        | its first page again, masked; zeroed too when that
                                       | page is its only one (then not full)

    Unwritten slots are zeroed because masking a score leaves a NaN key or value in; padding
    repeats a full page of the row's own, so only a row's own cached keys fill it.
    """

    rows: Tensor  # [B] packed row of each decode token
    page_ids: Tensor  # [B * pages per row] the padded page tables, row after row
    new_keys: Tensor  # [B] flat key index b * T + start_pos of each new token
    unused_keys: Tensor  # flat key index b * T + t of every column t zeroed (see the table)
    key_mask: Tensor  # [B, 1, 1, T] True where a key may be attended


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How each layer attends; built once per forward, shared by every layer."""

    prefills: tuple[Span, ...]
    extends: tuple[Span, ...]
    decodes: tuple[DecodeBatch, ...]  # the decodes in padded batches of similar table lengths


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
    q: Tensor, k: Tensor, v: Tensor, decodes: DecodeBatch, kv_pages: Tensor, layer: int
) -> Tensor:
    """All decode tokens in one SDPA: each row's query heads are folded under their kv head, so no
    K/V copy per head."""
    num_batch = len(decodes.rows)
    keys, values = gather_pages(kv_pages, decodes.page_ids, layer)  # fresh [B * T, kv_heads, d]
    for cached, new in ((keys, k), (values, v)):
        # an unwritten slot may hold anything, NaN included, which masking its score leaves in
        cached.index_fill_(0, decodes.unused_keys, 0)
        cached.index_copy_(0, decodes.new_keys, new[decodes.rows].to(cached.dtype))
    num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
    # [B, kv_heads, group, d]
    grouped_q = q[decodes.rows].view(num_batch, num_kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(
        grouped_q,
        keys.to(q.dtype).view(num_batch, -1, num_kv_heads, head_dim).transpose(1, 2),
        values.to(q.dtype).view(num_batch, -1, num_kv_heads, head_dim).transpose(1, 2),
        attn_mask=decodes.key_mask,
    )
    return out.reshape(num_batch, -1, head_dim)


def plan_attention(
    spans: list[Span], kv_pages: Tensor, max_decode_batches: int | None = None
) -> AttentionPlan:
    """The spans by kind, decodes in at most ``max_decode_batches`` padded batches
    (``decode_groups``; default: the device's) for attending ``kv_pages``. Pure."""
    page_size, device = kv_pages.shape[3], kv_pages.device
    decode_spans = [s for s in spans if s.start_pos > 0 and s.num_new == 1]
    max_batches = max_decode_batches or default_decode_batches(device)
    layer_page_bytes = math.prod(kv_pages.shape[2:]) * kv_pages.element_size()  # its K and V
    cost_pages = -(-DECODE_BATCH_COST_BYTES // layer_page_bytes)
    table_lengths = [_pages_read(s, page_size) for s in decode_spans]
    groups = decode_groups(table_lengths, max_batches, cost_pages)
    return AttentionPlan(
        prefills=tuple(s for s in spans if s.start_pos == 0),
        extends=tuple(s for s in spans if s.start_pos > 0 and s.num_new > 1),
        decodes=tuple(
            _plan_decodes([decode_spans[i] for i in group], page_size, device) for group in groups
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


def _plan_decodes(spans: list[Span], page_size: int, device: torch.device) -> DecodeBatch:
    """The padded batch of the decode spans (see ``DecodeBatch``). Pure."""
    tables = [s.page_ids[: _pages_read(s, page_size)] for s in spans]
    pages_per_row = max(map(len, tables))
    num_columns = pages_per_row * page_size
    padded_tables, unused_keys = [], []
    for row, (span, table) in enumerate(zip(spans, tables)):
        padded_tables.extend([*table, *[table[0]] * (pages_per_row - len(table))])
        end_of_zeroed = (len(table) if len(table) > 1 else pages_per_row) * page_size
        unused_keys.extend(
            range(row * num_columns + span.start_pos + 1, row * num_columns + end_of_zeroed)
        )
    start_pos = torch.tensor([s.start_pos for s in spans], device=device)
    row_offsets = torch.arange(len(spans), device=device) * num_columns
    key_columns = torch.arange(num_columns, device=device)[None, :]  # [1, T]
    is_used = key_columns <= start_pos[:, None]  # [B, T]
    return DecodeBatch(
        rows=torch.tensor([s.row_start for s in spans], device=device),
        page_ids=page_table_tensor(padded_tables, device),
        new_keys=row_offsets + start_pos,
        unused_keys=torch.tensor(unused_keys, dtype=torch.int64, device=device),
        key_mask=is_used[:, None, None, :],
    )
