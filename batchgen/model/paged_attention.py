"""Attention over KV pages: the per-forward plan and one attention per kind of sequence.

A forward's sequences are packed rows (``Span``); the plan sorts them by kind once
and every layer attends with it:

    kind     | start_pos | new tokens | attention
    ---------+-----------+------------+------------------------------------------------
    prefill  | 0         | n >= 1     | SDPA with is_causal over its own tokens
    decode   | > 0       | 1          | one padded, masked SDPA for all decodes together
    extend   | > 0       | n > 1      | SDPA over cached + new K/V with an explicit mask

Everything here reads ``kv_pages`` and never writes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from batchgen.model.paged_kv import gather_kv, gather_pages, page_table_tensor


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
    """All one-token sequences with a cached history, attended as one padded batch of B rows.

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
    decodes: DecodeBatch | None


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


def plan_attention(spans: list[Span], page_size: int, device: torch.device) -> AttentionPlan:
    """The spans by kind, decodes as one padded batch. Pure."""
    decode_spans = [s for s in spans if s.start_pos > 0 and s.num_new == 1]
    return AttentionPlan(
        prefills=tuple(s for s in spans if s.start_pos == 0),
        extends=tuple(s for s in spans if s.start_pos > 0 and s.num_new > 1),
        decodes=_plan_decodes(decode_spans, page_size, device) if decode_spans else None,
    )


def _plan_decodes(spans: list[Span], page_size: int, device: torch.device) -> DecodeBatch:
    """The padded batch of the decode spans (see ``DecodeBatch``). Pure."""
    tables = [s.page_ids[: s.start_pos // page_size + 1] for s in spans]
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
