"""The decoder's elementwise layers: RMSNorm with its residual sum, RoPE, and the MLP's SiLU.

Each runs as torch ops, or, for float32 on a CPU, as one of ``fused_cpu``'s kernels: between
matmuls that stream their weights, a decode's small ops cost several times what they cost alone,
so one call in place of eight or ten matters (``docs/benchmarks-engine.md``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchgen.config import ModelConfig


def fuses_on_cpu(x: Tensor) -> bool:
    """Whether ``x``'s elementwise steps run as ``fused_cpu``'s kernels: float32 on a CPU. Pure."""
    return x.is_cpu and x.dtype == torch.float32


@functools.cache
def fused_cpu():
    """The kernels module, imported at first use: numba loads only where a forward fuses. Cached:
    each of a forward's dozen calls would run the import machinery again."""
    from batchgen.model import fused_cpu as kernels

    return kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self._weight_view: tuple[int, np.ndarray | None] = (0, None)  # see weight_array

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The scaled norm of ``x + residual`` and that sum, the residual stream (``x`` itself
        without a residual): vLLM's and SGLang's fused residual, the same sums as HF's. Normalised
        in float32, scaled in the input dtype, as HF does; float32 on a CPU is one kernel
        (``fused_cpu``). Writes the sum into ``x``."""
        if fuses_on_cpu(x):
            out = torch.empty_like(x)
            weight, eps = self.weight_array(), np.float32(self.eps)
            if residual is None:
                fused_cpu().rms_norm(x.numpy(), weight, eps, out.numpy())
            else:
                fused_cpu().add_rms_norm(x.numpy(), residual.numpy(), weight, eps, out.numpy())
            return out, x
        if residual is not None:
            x = x.add_(residual)
        # F.rms_norm is one op for HF's five, with the same float32 result
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
        return normed.mul_(self.weight), x

    def weight_array(self) -> np.ndarray:
        """``weight`` as a numpy array over its memory, kept until that memory moves (``.to``, a
        new Parameter; ``load_state_dict`` copies into the same memory, which the array shows). A
        decode's norm spent a quarter of its time making it. The kept array holds on to the old
        memory, so no later weight can take its address. Mutates the kept view."""
        address = self.weight.data_ptr()
        if self._weight_view[0] != address:
            self._weight_view = (address, self.weight.detach().numpy())
        return self._weight_view[1]


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
        """cos and signed sin for ``positions`` [N], each [N, 1, head_dim] in ``dtype``: sin's
        first half negated, as ``apply_rope`` takes it."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        return angles.cos().to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` [N, I] of ``gate_up`` [N, 2 * I] (gate its first half): float32 on a
    CPU as one kernel, elsewhere torch's SiLU with the product in place on its fresh output (a
    prefill's [tokens, I] buffers are the largest of a forward, and each fresh one costs its page
    faults). Pure."""
    if fuses_on_cpu(gate_up):
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        fused_cpu().silu_and_mul(gate_up.numpy(), out.numpy())
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate ``x`` [N, heads, head_dim] with the rotate_half convention: HF's
    ``cat(-x2, x1) * sin`` is ``cat(x2, x1) * cat(-sin, sin)`` exactly (a negation rounds nothing),
    one roll instead of two slices, a negation and a cat."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rope_split(
    qkv: Tensor, cos: Tensor, signed_sin: Tensor, num_heads: int, kv_out: Tensor
) -> Tensor:
    """From ``qkv`` [N, heads + 2 * kv_heads, d], q rotated [N, heads, d], and the new K
    (rotated) and V stacked into ``kv_out`` [2, N, kv_heads, d] (a layer's slot of the forward's
    new K/V); float32 on a CPU as one kernel with ``apply_rope``'s bits. Writes ``kv_out``."""
    num_rows, head_dim = qkv.shape[0], qkv.shape[2]
    num_roped = num_heads + kv_out.shape[2]
    if fuses_on_cpu(qkv):
        q = qkv.new_empty(num_rows, num_heads, head_dim)
        kernel = fused_cpu().rope_split
        kernel(qkv.numpy(), cos.numpy(), signed_sin.numpy(), num_heads, q.numpy(), kv_out.numpy())
        return q
    q, k = apply_rope(qkv[:, :num_roped], cos, signed_sin).split((num_heads, kv_out.shape[2]), 1)
    kv_out[0], kv_out[1] = k, qkv[:, num_roped:]
    return q
