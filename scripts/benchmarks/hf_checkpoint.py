"""The HF side of the benchmarks: a seeded Llama checkpoint (``throughput``, ``generate``,
``replicas``, ``vllm``) and HF greedy ``generate`` in static batches (``throughput``; the near-tie
test of a request whose tokens differ from HF's is ``batchgen.validation.hf_oracle.near_tie``,
which validate's HF oracle uses too).
"""

from __future__ import annotations

import math

import torch
import transformers

# name -> HF LlamaConfig keys; "HxL" names a CPU geometry (head_dim 64, 2 query heads per KV head)
NAMED_GEOMETRIES = {
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
    ),
}


def hf_geometry(name: str, vocab_size: int) -> dict:
    """HF LlamaConfig keys for a named geometry or ``HxL``; ValueError for neither. Pure."""
    if name in NAMED_GEOMETRIES:
        return NAMED_GEOMETRIES[name]
    hidden, _, layers = name.partition("x")
    if not (hidden.isdigit() and layers.isdigit() and int(hidden) % 64 == 0 and int(layers)):
        raise ValueError(f"geometry {name!r}: expected HxL with H a multiple of 64, or llama-1b")
    num_heads = int(hidden) // 64
    return dict(
        hidden_size=int(hidden),
        intermediate_size=64 * math.ceil(8 * int(hidden) / 3 / 64),
        num_hidden_layers=int(layers),
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=64,
        vocab_size=vocab_size,
    )


def save_checkpoint(path: str, geometry: dict, seed: int, dtype: torch.dtype):
    """An HF Llama with seeded weights (order-1 logits: clear greedy argmaxes), saved to ``path``;
    returns the HF model."""
    config = transformers.LlamaConfig(
        **geometry, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None
    )
    model = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                scale = 1.0 if "embed_tokens" in name else 1 / math.sqrt(param.shape[1])
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model = model.to(dtype)
    model.save_pretrained(path)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # every request runs to its length
    return model


def hf_generate(
    model, prompts: list[list[int]], new_tokens: list[int], batch_size: int, device: str
) -> list[list[int]]:
    """HF greedy tokens of every request: static batches of ``batch_size`` in order, left-padded,
    each until its longest request ends, cut to the ``new_tokens`` each request asked for."""
    outputs = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        batch_new_tokens = new_tokens[start : start + batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max(batch_new_tokens),
                do_sample=False,
            )
        for row, num_new in zip(generated[:, width:].tolist(), batch_new_tokens):
            outputs.append(row[:num_new])
    return outputs
