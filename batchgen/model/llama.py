"""Llama-family decoder (Llama, Qwen2) whose attention reads its history from KV pages.

Parameter names match HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``, so an HF
state dict loads as is. A forward packs the new tokens of every sequence into
one ``[total_tokens, hidden]`` matrix for the projections and the MLP; only
attention is per kind of sequence:

    kind     | start_pos | new tokens | attention
    ---------+-----------+------------+------------------------------------------------
    prefill  | 0         | n >= 1     | SDPA with is_causal over its own tokens
    decode   | > 0       | 1          | one padded, masked SDPA for all decodes together
    extend   | > 0       | n > 1      | SDPA over cached + new K/V with an explicit mask

The forward never writes ``kv_pages``: it returns each sequence's new K/V and the
worker writes them later with ``paged_kv.write_kv``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgen.config import ModelConfig
from batchgen.model.paged_kv import gather_kv, gather_pages, page_table_tensor


@dataclass(frozen=True, slots=True)
class SeqInput:
    """One sequence's work in a forward."""

    token_ids: Sequence[int]  # the new tokens of this sequence this step (all its uncached tokens)
    # tokens already cached in pages; the new tokens are positions [start_pos, start_pos+len)
    start_pos: int
    # the sequence's page table; pages cover at least start_pos+len positions
    page_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """What a forward produced; ``logits`` and ``new_kv`` follow the order of the input
    sequences."""

    logits: Tensor  # [num_seqs, vocab_size] float32: logits of each sequence's LAST new token
    # per seq: [num_layers, 2, n_new, num_kv_heads, head_dim] in kv_pages.dtype (K after RoPE)
    new_kv: list[Tensor]


@dataclass(frozen=True, slots=True)
class _Span:
    """One sequence's rows ``[row_start, row_start + num_new)`` of the packed batch."""

    row_start: int
    num_new: int
    start_pos: int
    page_ids: Sequence[int]

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_start + self.num_new)


@dataclass(frozen=True, slots=True)
class _DecodeBatch:
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
class _AttentionPlan:
    """How each layer attends; built once per forward, shared by every layer."""

    prefills: tuple[_Span, ...]
    extends: tuple[_Span, ...]
    decodes: _DecodeBatch | None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalise in float32, scale in the input dtype (as HF does)."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE; ``inv_freq`` is a float32 buffer computed on CPU, not in state
    dicts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        exponents = (
            torch.arange(0, config.head_dim, 2, dtype=torch.int64, device="cpu").float()
            / config.head_dim
        )
        self.register_buffer("inv_freq", 1.0 / (config.rope_theta**exponents), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin for ``positions`` [N], each [N, head_dim] in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [N, heads, head_dim] with the rotate_half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        plan: _AttentionPlan,
        kv_pages: Tensor,
        layer: int,
    ) -> tuple[Tensor, Tensor]:
        """Attention output [N, hidden] and this layer's new K/V [2, N, kv_heads, head_dim]; reads
        ``kv_pages`` only."""
        num_rows = x.shape[0]
        q = apply_rope(self.q_proj(x).view(num_rows, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(num_rows, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(num_rows, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        for span in plan.prefills:
            out[span.rows] = _attend_one(q[span.rows], k[span.rows], v[span.rows], key_mask=None)
        for span in plan.extends:
            out[span.rows] = _attend_extend(q, k, v, span, kv_pages, layer)
        if plan.decodes is not None:
            out[plan.decodes.rows] = _attend_decodes(q, k, v, plan.decodes, kv_pages, layer)
        return self.o_proj(out.view(num_rows, -1)), torch.stack((k, v))


def _attend_one(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None) -> Tensor:
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


def _attend_extend(
    q: Tensor, k: Tensor, v: Tensor, span: _Span, kv_pages: Tensor, layer: int
) -> Tensor:
    """A sequence with cached history and several new tokens: new token i sees keys
    0..start_pos+i."""
    cached_k, cached_v = gather_kv(kv_pages, span.page_ids, span.start_pos, layer)
    keys = torch.cat((cached_k.to(k.dtype), k[span.rows]))
    values = torch.cat((cached_v.to(v.dtype), v[span.rows]))
    query_pos = span.start_pos + torch.arange(span.num_new, device=q.device)
    key_mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= query_pos[:, None]
    return _attend_one(q[span.rows], keys, values, key_mask)


def _attend_decodes(
    q: Tensor, k: Tensor, v: Tensor, decodes: _DecodeBatch, kv_pages: Tensor, layer: int
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


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: Tensor,
        cos: Tensor,
        sin: Tensor,
        plan: _AttentionPlan,
        kv_pages: Tensor,
        layer: int,
    ) -> tuple[Tensor, Tensor]:
        """New hidden [N, hidden] and this layer's new K/V [2, N, kv_heads, head_dim]."""
        attn_out, new_kv = self.self_attn(
            self.input_layernorm(hidden), cos, sin, plan, kv_pages, layer
        )
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), new_kv


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        token_ids: Tensor,
        positions: Tensor,
        plan: _AttentionPlan,
        kv_pages: Tensor,
        output_rows: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Final-normed hidden of ``output_rows`` and new K/V [layers, 2, N, kv_heads, head_dim] in
        the pages' dtype."""
        hidden = self.embed_tokens(token_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        layer_kvs = []
        for layer, decoder in enumerate(self.layers):
            hidden, layer_kv = decoder(hidden, cos, sin, plan, kv_pages, layer)
            layer_kvs.append(layer_kv.to(kv_pages.dtype))
        return self.norm(hidden[output_rows]), torch.stack(layer_kvs)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, make ``lm_head.weight`` the embedding Parameter itself;
        mutates lm_head."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqInput], kv_pages: Tensor) -> ForwardOutput:
        """Logits of each sequence's last new token and the new tokens' K/V; reads ``kv_pages``,
        never writes it."""
        device = self.model.embed_tokens.weight.device
        spans = _pack(seqs, page_size=kv_pages.shape[3])
        token_ids = torch.tensor(
            list(itertools.chain.from_iterable(s.token_ids for s in seqs)), device=device
        )
        num_new = [span.num_new for span in spans]
        pos_offsets = torch.tensor(
            [span.start_pos - span.row_start for span in spans], device=device
        )
        positions = torch.arange(len(token_ids), device=device) + pos_offsets.repeat_interleave(
            torch.tensor(num_new, device=device), output_size=len(token_ids)
        )
        last_rows = torch.tensor(
            [span.row_start + span.num_new - 1 for span in spans], device=device
        )
        plan = _plan_attention(spans, kv_pages.shape[3], device)
        hidden, new_kv = self.model(token_ids, positions, plan, kv_pages, last_rows)
        return ForwardOutput(
            logits=self.lm_head(hidden).float(), new_kv=list(new_kv.split(num_new, dim=2))
        )


def _pack(seqs: Sequence[SeqInput], page_size: int) -> list[_Span]:
    """Rows of each sequence in the packed batch; checks every sequence is non-empty and covered by
    its pages."""
    if not seqs:
        raise ValueError("forward needs at least one sequence")
    spans, row_start = [], 0
    for index, seq in enumerate(seqs):
        num_new = len(seq.token_ids)
        end_pos = seq.start_pos + num_new
        if num_new == 0:
            raise ValueError(f"sequence {index} has no new tokens")
        if len(seq.page_ids) * page_size < end_pos:
            raise ValueError(
                f"sequence {index}: {len(seq.page_ids)} pages of {page_size} do not cover positions"
                f" [0, {end_pos})"
            )
        spans.append(_Span(row_start, num_new, seq.start_pos, seq.page_ids))
        row_start += num_new
    return spans


def _plan_attention(spans: list[_Span], page_size: int, device: torch.device) -> _AttentionPlan:
    decode_spans = [s for s in spans if s.start_pos > 0 and s.num_new == 1]
    return _AttentionPlan(
        prefills=tuple(s for s in spans if s.start_pos == 0),
        extends=tuple(s for s in spans if s.start_pos > 0 and s.num_new > 1),
        decodes=_plan_decodes(decode_spans, page_size, device) if decode_spans else None,
    )


def _plan_decodes(spans: list[_Span], page_size: int, device: torch.device) -> _DecodeBatch:
    """The padded batch of the decode spans (see ``_DecodeBatch``). Pure."""
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
    return _DecodeBatch(
        rows=torch.tensor([s.row_start for s in spans], device=device),
        page_ids=page_table_tensor(padded_tables, device),
        new_keys=row_offsets + start_pos,
        unused_keys=torch.tensor(unused_keys, dtype=torch.int64, device=device),
        key_mask=is_used[:, None, None, :],
    )
