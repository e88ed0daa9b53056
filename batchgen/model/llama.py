"""Llama-family decoder (Llama, Qwen2) whose attention reads its history from KV pages.

Parameters are HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM``'s, but for q/k/v and gate/up,
each stacked into one matrix (``stacked``): the loader fills them from HF's names, and
``state_dict`` gives HF's names back. A forward packs the new tokens of every sequence into
one ``[total_tokens, hidden]`` matrix for the projections and the MLP; only
attention is per kind of sequence (prefill, decode, extend), planned once per
forward by ``paged_attention``, which holds the three attentions.

The forward never writes ``kv_pages``: it returns each sequence's new K/V and
the worker writes them later with ``paged_kv.write_kvs``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from batchgen.config import ModelConfig
from batchgen.model.elementwise import RMSNorm, RotaryEmbedding, rope_split, silu_and_mul
from batchgen.model.paged_attention import (
    AttentionPlan,
    Span,
    attend_extend,
    attend_sequence,
    plan_attention,
)
from batchgen.model.paged_kv import page_size_of
from batchgen.model.stacked import hf_tensors


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


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # HF's gate_proj and up_proj, stacked (``stacked``): one matmul
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """``down(silu(gate(x)) * up(x))`` (``elementwise.silu_and_mul``)."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        # HF's q_proj, k_proj and v_proj, stacked (``stacked``): one matmul
        self.qkv_proj = nn.Linear(
            config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        plan: AttentionPlan,
        kv_pages: Tensor,
        layer: int,
        new_kv: Tensor,
    ) -> Tensor:
        """Attention output [N, hidden], with this layer's new K/V written into ``new_kv`` [2, N,
        kv_heads, head_dim]; reads ``kv_pages``."""
        num_rows = x.shape[0]
        qkv = self.qkv_proj(x).view(num_rows, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q = rope_split(qkv, cos, sin, self.num_heads, new_kv)
        out = q.new_empty(q.shape)
        for span in plan.prefills:
            rows = span.rows
            out[rows] = attend_sequence(q[rows], new_kv[0, rows], new_kv[1, rows], key_mask=None)
        for span in plan.extends:
            out[span.rows] = attend_extend(q, new_kv[0], new_kv[1], span, kv_pages, layer)
        for decodes in plan.decodes:
            decodes.attend(q, new_kv, kv_pages, layer, out)
        return self.o_proj(out.view(num_rows, -1))


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
        residual: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        plan: AttentionPlan,
        kv_pages: Tensor,
        layer: int,
        new_kv: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """This layer's MLP output and the residual stream [N, hidden] (the next norm sums them);
        its new K/V written into ``new_kv`` [2, N, kv_heads, head_dim]. ``hidden`` is the previous
        layer's output, or the embeddings with ``residual`` None. Writes each residual sum into
        the fresh sublayer output it adds to."""
        x, residual = self.input_layernorm(hidden, residual)
        attn_out = self.self_attn(x, cos, sin, plan, kv_pages, layer, new_kv)
        x, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # on the meta device (the loader's) no values are drawn: the default init would import
        # torch._dynamo (~1 s) to draw values the checkpoint replaces
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        if not embedding.is_meta:
            nn.init.normal_(embedding)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        token_ids: Tensor,
        positions: Tensor,
        plan: AttentionPlan,
        kv_pages: Tensor,
        output_rows: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Final-normed hidden of ``output_rows`` and new K/V [layers, 2, N, kv_heads, head_dim] in
        the pages' dtype: each layer writes its own slot, so no copy gathers them."""
        hidden, residual = self.embed_tokens(token_ids), None
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        attention = self.layers[0].self_attn
        new_kv = hidden.new_empty(
            len(self.layers), 2, len(token_ids), attention.num_kv_heads, attention.head_dim
        )
        for layer, decoder in enumerate(self.layers):
            hidden, residual = decoder(
                hidden, residual, cos, sin, plan, kv_pages, layer, new_kv[layer]
            )
        normed, _ = self.norm(hidden[output_rows], residual[output_rows])
        return normed, new_kv.to(kv_pages.dtype)


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

    def state_dict(self, *args, **kwargs) -> dict[str, Tensor]:
        """The weights as an HF checkpoint names and shapes them: each stacked projection as its
        HF parts (``stacked.hf_tensors``). Pure."""
        return hf_tensors(super().state_dict(*args, **kwargs), self.config)

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqInput], kv_pages: Tensor) -> ForwardOutput:
        """Logits of each sequence's last new token and the new tokens' K/V; reads ``kv_pages``,
        never writes it."""
        device = self.model.embed_tokens.weight.device
        spans = _pack(seqs, page_size=page_size_of(kv_pages))
        token_ids = torch.tensor(
            list(itertools.chain.from_iterable(s.token_ids for s in seqs)), device=device
        )
        num_new = [span.num_new for span in spans]
        # one tensor from a list: a decode's few rows cost a few small ops each otherwise
        positions = torch.tensor(
            [pos for span in spans for pos in range(span.start_pos, span.start_pos + span.num_new)],
            device=device,
        )
        last_rows = torch.tensor(
            [span.row_start + span.num_new - 1 for span in spans], device=device
        )
        plan = plan_attention(spans, kv_pages)
        hidden, new_kv = self.model(token_ids, positions, plan, kv_pages, last_rows)
        return ForwardOutput(
            logits=self.lm_head(hidden).float(), new_kv=list(new_kv.split(num_new, dim=2))
        )


def _pack(seqs: Sequence[SeqInput], page_size: int) -> list[Span]:
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
        spans.append(Span(row_start, num_new, seq.start_pos, seq.page_ids))
        row_start += num_new
    return spans
