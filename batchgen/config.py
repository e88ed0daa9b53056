"""Frozen, validated configuration: model geometry, cache geometry, engine limits.

Every config is a pydantic model (it is read at the edges: CLI, ``config.json``,
workload files) and frozen, so a component that receives one cannot change it.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_TENSOR_DIM = 2**63 - 1  # torch sizes are int64: a page tensor's dimensions cannot exceed it


def validation_summary(
    error: ValidationError, limit: int = 5, names: dict[str, str] | None = None
) -> str:
    """``field.path: message; ...`` for the first ``limit`` problems (no pydantic internals);
    ``names`` renames fields to what the input called them."""
    names = names or {}
    problems = [
        f"{'.'.join(str(names.get(part, part)) for part in e['loc']) or '<root>'}: {e['msg']}"
        for e in error.errors()[:limit]
    ]
    more = error.error_count() - limit
    return "; ".join(problems) + (f"; and {more} more" if more > 0 else "")


class _Frozen(BaseModel):
    # Python callers too: no True or "8" for 8
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ModelConfig(_Frozen):
    """Geometry of a Llama-family decoder (names follow HF ``LlamaConfig``)."""

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    max_context: int = Field(gt=0, description="max_position_embeddings")
    rope_theta: float = Field(default=10000.0, gt=0, allow_inf_nan=False)
    rms_norm_eps: float = Field(default=1e-6, gt=0, allow_inf_nan=False)
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()  # a generated token in it ends the request ("eos")

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads"
                f" ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs of dimensions"
            )
        return self

    # Fields whose HF config.json key differs (from_hf_dict reads them from it).
    HF_KEYS: ClassVar[dict[str, str]] = {
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
        "max_context": "max_position_embeddings",
        "eos_token_ids": "eos_token_id",
    }

    @classmethod
    def from_hf_dict(cls, hf: dict) -> ModelConfig:
        """Build from a HF ``config.json`` dict (Llama or Qwen2 keys), validated strictly: no
        ``true`` or ``"16"`` where a number belongs (an integer may stand for a float, as
        ``"rope_theta": 500000`` does)."""
        num_heads = hf["num_attention_heads"]
        # not a bool either: JSON's true is no head count
        if type(num_heads) is not int or num_heads <= 0:
            raise ValueError(f"num_attention_heads must be a positive integer, got {num_heads!r}")
        # one id, a list of them (Llama 3: end of text, of turn, ...), or null
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls.model_validate(
            dict(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=hf.get("num_key_value_heads") or num_heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
                max_context=hf.get("max_position_embeddings", 2048),
                rope_theta=hf.get("rope_theta")
                or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                attention_bias=hf.get("attention_bias", hf.get("model_type") == "qwen2"),
                tie_word_embeddings=hf.get("tie_word_embeddings", False),
                eos_token_ids=eos_ids,
            ),
            strict=True,
        )


TINY_MODELS: dict[str, ModelConfig] = {
    # CPU-sized; context reaches the L2-4096 workload.
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_context=4608,
    ),
    # Llama-2-7B geometry (random weights) for GPU validation.
    "llama2-7b-geometry": ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        max_context=4096,
        rms_norm_eps=1e-5,
    ),
}


# the worker's slice gates (``batchgen.kv.gate``, ``batchgen.finish.gate``): each family's
# variables are not typos of another's
KV_GATE_PREFIX, FINISH_GATE_PREFIX = "BATCHGEN_WORKER_KV_", "BATCHGEN_WORKER_FINISH_"
WORKER_GATE_PREFIXES = (KV_GATE_PREFIX, FINISH_GATE_PREFIX)


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens: ``ceil(num_tokens / page_size)``. Pure."""
    return -(-num_tokens // page_size)


def watermark_pages(watermark: float, num_gpu_pages: int) -> int:
    """GPU pages a pool of ``num_gpu_pages`` keeps free (the plan layer computes the same from its
    snapshot)."""
    return math.ceil(watermark * num_gpu_pages)


class CacheConfig(_Frozen):
    """Geometry of the two KV page pools.

    A page holds ``page_size`` tokens of K and V for every layer. ``watermark`` is
    the fraction of GPU pages the worker keeps free; running below it triggers
    eviction to host.
    """

    page_size: int = Field(default=16, gt=0, le=MAX_TENSOR_DIM)
    num_gpu_pages: int = Field(gt=0, le=MAX_TENSOR_DIM)
    num_host_pages: int = Field(ge=0, le=MAX_TENSOR_DIM)
    dtype: str = "float32"
    watermark: float = Field(default=0.02, ge=0.0, lt=1.0, allow_inf_nan=False)
    # full prompt pages reused across requests (the policy: ``batchgen.kv.manager``)
    enable_prefix_caching: bool = False

    @model_validator(mode="after")
    def _check_dtype_and_watermark(self) -> CacheConfig:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if self.watermark_pages >= self.num_gpu_pages:  # no page left to serve a request
            raise ValueError(
                f"watermark {self.watermark} keeps ceil({self.watermark} x {self.num_gpu_pages}) ="
                f" {self.watermark_pages} of the {self.num_gpu_pages} GPU pages free, leaving none"
                " to use; lower the watermark or give more GPU pages"
            )
        return self

    @property
    def watermark_pages(self) -> int:
        """GPU pages kept free: ``ceil(watermark * num_gpu_pages)``."""
        return watermark_pages(self.watermark, self.num_gpu_pages)


class EngineConfig(_Frozen):
    """Per-step limits of the continuous batcher and the load-failure policy."""

    max_num_batched_tokens: int = Field(
        default=2048,
        gt=0,
        description=(
            "token budget per step: decodes count one token each, and a waiting request is admitted"
            " only within what is left, except the step's first admitted one, which may exceed it"
            " (there is no chunked prefill, so a prompt longer than the budget must run whole)"
        ),
    )
    max_num_seqs: int = Field(default=64, gt=0, description="requests scheduled per step")
    max_load_retries: int = Field(default=1, ge=0, description="retries of a failed host->GPU load")
    load_timeout_steps: int = Field(
        default=8, ge=1, description="steps a load may stay incomplete before it fails"
    )
    load_failure: Literal["recompute", "fail"] = Field(
        default="recompute", description="after the last retry: recompute the request, or fail it"
    )
    schedule_policy: Literal["fcfs", "lof"] = Field(
        default="fcfs",
        description=(
            "the order WAITING requests are admitted in: fcfs, oldest first; lof, longest output"
            " first (most new tokens still allowed), which ends a batch whose requests differ in"
            " max_new_tokens in fewer steps"
        ),
    )
