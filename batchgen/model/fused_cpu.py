"""The elementwise steps of a float32 CPU forward, each fused into one numba kernel.

A decode forward's small tensor ops cost far more inside the model than alone: between matmuls
that stream megabytes of weights, every op's dispatch runs cold. torch's RMSNorm is about eight
ops, RoPE over q and k with the new K/V's stack about ten, the MLP's activation three (a slice,
SiLU, a product); each kernel here is one call:

    add_rms_norm   x + residual (written into x) and its RMSNorm, scaled: what vLLM and SGLang
                   call fused_add_rms_norm; the sum of squares in another order than torch's
    rope_split     q rotated, and the new K (rotated) and V stacked as the pages take them;
                   ``elementwise.apply_rope``'s products and sums, rounded alike: same bits
    silu_and_mul   the MLP's ``silu(gate) * up``, within three ulp of the exact product

Compiled on first call and cached on disk beside this file, as ``paged_decode_kernel`` is.
"""

from __future__ import annotations

import numba
import numpy as np

from batchgen.model.paged_decode_kernel import exp_nonpositive

# reassociation lets the sum of squares vectorise; nothing else is reordered
SUM_FASTMATH = {"reassoc", "nsz", "arcp"}


@numba.njit(fastmath=SUM_FASTMATH, cache=True, boundscheck=False)
def rms_norm(x, weight, eps, out):
    """``out[r] = x[r] / sqrt(mean(x[r]**2) + eps) * weight`` for each row of ``x`` [N, H]:
    normalised, then scaled, as HF rounds it. Writes ``out``."""
    for row in range(x.shape[0]):
        _norm_row(x[row], weight, eps, out[row])


@numba.njit(fastmath=SUM_FASTMATH, cache=True, boundscheck=False)
def add_rms_norm(x, residual, weight, eps, out):
    """``x += residual``, then ``rms_norm`` of that sum into ``out``, row by row (the sum is
    read back while still in cache). Writes ``x`` and ``out``."""
    for row in range(x.shape[0]):
        summed = x[row]
        for e in range(x.shape[1]):
            summed[e] += residual[row, e]
        _norm_row(summed, weight, eps, out[row])


@numba.njit(fastmath=SUM_FASTMATH, boundscheck=False, inline="always")
def _norm_row(x, weight, eps, out):
    """One row of ``rms_norm``. Writes ``out``."""
    squares = np.float32(0.0)
    for e in range(x.shape[0]):
        squares += x[e] * x[e]
    scale = np.float32(1.0) / np.sqrt(squares / np.float32(x.shape[0]) + eps)
    for e in range(x.shape[0]):
        out[e] = (x[e] * scale) * weight[e]


@numba.njit(cache=True, boundscheck=False)
def rope_split(qkv, cos, signed_sin, num_heads, q_out, kv_out):
    """``qkv`` [N, heads + 2 * kv_heads, d] (q, k, v heads in order) with each row's ``cos`` and
    ``signed_sin`` [N, 1, d] (``elementwise.RotaryEmbedding``): the rotated q into ``q_out``
    [N, heads, d], the rotated k and the v into ``kv_out`` [2, N, kv_heads, d]. Each element is
    ``x[e] * cos[e] + x[e +- d/2] * signed_sin[e]`` in float32, no product fused into its sum:
    ``apply_rope``'s bits. Writes ``q_out`` and ``kv_out``."""
    num_kv_heads, head_dim = kv_out.shape[2], qkv.shape[2]
    half = head_dim // 2
    for row in range(qkv.shape[0]):
        for head in range(num_heads + num_kv_heads):
            x = qkv[row, head]
            out = q_out[row, head] if head < num_heads else kv_out[0, row, head - num_heads]
            for e in range(head_dim):
                partner = x[e + half] if e < half else x[e - half]
                out[e] = x[e] * cos[row, 0, e] + partner * signed_sin[row, 0, e]
        kv_out[1, row] = qkv[row, num_heads + num_kv_heads :]


# numpy's error model: python's checks every division for a zero divisor, and that branch keeps
# the loop from vectorising (seven times slower)
@numba.njit(fastmath=SUM_FASTMATH, cache=True, boundscheck=False, error_model="numpy")
def silu_and_mul(gate_up, out):
    """``out[r] = silu(gate) * up`` for each row of ``gate_up`` [N, 2 * I] (gate its first I
    columns, up the rest; ``out`` [N, I]): HF's ``act_fn(gate_proj(x)) * up_proj(x)`` in one pass,
    within three ulp of the exact product (e**x is ``paged_decode_kernel``'s). Writes ``out``."""
    size = out.shape[1]
    for row in range(gate_up.shape[0]):
        gate, up, result = gate_up[row, :size], gate_up[row, size:], out[row]
        for e in range(size):
            x = gate[e]
            decay = exp_nonpositive(min(x, -x))  # e**-|x|: no overflow either side of zero
            numerator = x if x >= 0 else x * decay  # x e**x / (1 + e**x) below zero
            result[e] = numerator / (np.float32(1.0) + decay) * up[e]
