"""HF's separate projections, stacked into one matrix each: one matmul where HF runs three or two.

A decode step's matmuls are a few rows against every weight, so each call's weights stream in
from memory; one call over the stacked matrix reads them in one pass and saves the calls (vLLM
stacks the same projections). Checkpoints keep HF's names and shapes: the loader fills each part's
rows of its stacked parameter (``stacked_location``), and ``hf_tensors`` splits them back out.
In each decoder layer, along the output rows (q, kv: heads x head_dim; i: intermediate size)::

    stacked parameter        | rows             | HF's name
    -------------------------+------------------+----------------------
    self_attn.qkv_proj.*     | [0, q)           | self_attn.q_proj.*
                             | [q, q + kv)      | self_attn.k_proj.*
                             | [q + kv, q + 2kv)| self_attn.v_proj.*
    mlp.gate_up_proj.weight  | [0, i)           | mlp.gate_proj.weight
                             | [i, 2i)          | mlp.up_proj.weight
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from torch import Tensor

from batchgen.config import ModelConfig

LAYER_PREFIX = "model.layers."


def stacked_parts(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each stacked module, as named inside a decoder layer, and its HF parts in row order with
    their row counts. Pure."""
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    intermediate = config.intermediate_size
    return {
        "self_attn.qkv_proj": (
            ("self_attn.q_proj", q_rows),
            ("self_attn.k_proj", kv_rows),
            ("self_attn.v_proj", kv_rows),
        ),
        "mlp.gate_up_proj": (("mlp.gate_proj", intermediate), ("mlp.up_proj", intermediate)),
    }


def hf_tensors(tensors: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """``tensors`` (this model's parameter names) under HF's names, in the same order: each stacked
    tensor as its parts, views of its rows. Pure."""
    parts = stacked_parts(config)
    renamed = {}
    for name, tensor in tensors.items():
        layer, stacked, attr = _split(name)
        if stacked not in parts:
            renamed[name] = tensor
            continue
        for (part, num_rows), start in zip(parts[stacked], _starts(parts[stacked])):
            renamed[f"{layer}{part}.{attr}"] = tensor.narrow(0, start, num_rows)
    return renamed


def stacked_location(name: str, config: ModelConfig) -> tuple[str, int, int] | None:
    """Where the HF tensor ``name`` lives in this model: (its stacked parameter's name, first row,
    end row); None for a name this model keeps as HF does. Pure."""
    layer, part_module, attr = _split(name)
    for stacked, parts in stacked_parts(config).items():
        for (part, num_rows), start in zip(parts, _starts(parts)):
            if part == part_module:
                return f"{layer}{stacked}.{attr}", start, start + num_rows
    return None


def _starts(parts: tuple[tuple[str, int], ...]) -> Iterator[int]:
    """The first row of each part. Pure."""
    return itertools.accumulate((num_rows for _, num_rows in parts), initial=0)


def _split(name: str) -> tuple[str, str, str]:
    """A decoder layer's parameter name as (``model.layers.N.``, module inside the layer,
    attribute); any other name as ("", "", name). Pure."""
    if not name.startswith(LAYER_PREFIX):
        return "", "", name
    index, _, rest = name[len(LAYER_PREFIX) :].partition(".")
    module, _, attr = rest.rpartition(".")
    return f"{LAYER_PREFIX}{index}.", module, attr
