"""Page digests: one int64 checksum per page and layer of a KV pool, in batched torch calls.

::

    pages [n, num_layers, ...]  viewed as int32 words  w[n, layer, j],  j = 0 .. W-1
    digest[n, layer] = sum_j  w[n, layer, j] * (j % WEIGHT_PERIOD + 1)          (exact in int64)

Why this is enough: a weight is never 0, so any change of one word changes the digest, and two
different weights tell a swap of two words (up to WEIGHT_PERIOD apart) from no change; a wrong,
stale or shifted page (the failure shapes of a copy or a write) differs in most of its words, so
its digest collides with the right one's only by a coincidence of a sum over 2**64. Every sum is
exact: |w| < 2**31 and weight <= WEIGHT_PERIOD < 2**12, so a page layer of up to 2**20 words (4 MiB)
stays below 2**63 (``check_digestible``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

WEIGHT_PERIOD = 4093  # a prime: weights 1..4093
MAX_LAYER_WORDS = 2**20  # the sums stay exact in int64 up to this many words a page layer
CHUNK_ELEMENTS = 2**23  # int64 elements of one chunk's products (64 MiB): bounds the staging


def page_digests(pool: Tensor, page_ids: Sequence[int] | Tensor) -> Tensor:
    """The digest of each page of ``page_ids`` in ``pool``, per layer: ``[len(page_ids),
    num_layers]`` int64 on the pool's device. Pure read of ``pool``."""
    index = torch.as_tensor(page_ids, dtype=torch.int64, device=pool.device)
    layer_words = _layer_words(pool)
    per_chunk = max(1, CHUNK_ELEMENTS // (pool.shape[1] * layer_words))
    chunks = [
        layer_digests(pool.index_select(0, index[start : start + per_chunk]))
        for start in range(0, len(index), per_chunk)
    ]
    if not chunks:
        return torch.empty((0, pool.shape[1]), dtype=torch.int64, device=pool.device)
    return torch.cat(chunks)


def layer_digests(pages: Tensor) -> Tensor:
    """The digest of each page of ``pages`` ``[n, num_layers, ...]`` per layer: ``[n,
    num_layers]`` int64. Pure."""
    layer_elements = math.prod(pages.shape[2:])
    words = pages.contiguous().view(*pages.shape[:2], layer_elements).view(torch.int32)
    weights = torch.arange(words.shape[2], device=pages.device, dtype=torch.int64)
    weights = weights % WEIGHT_PERIOD + 1
    return (words.to(torch.int64) * weights).sum(dim=2)


def check_digestible(pool: Tensor) -> None:
    """ValueError when the pool's page layers are no whole number of int32 words or too large for
    an exact digest. Pure."""
    _layer_words(pool)


def _layer_words(pool: Tensor) -> int:
    """The int32 words of one page layer of ``pool``; ValueError when digests cannot cover it."""
    layer_bytes = math.prod(pool.shape[2:]) * pool.element_size()
    if layer_bytes % 4 or layer_bytes // 4 > MAX_LAYER_WORDS:
        raise ValueError(
            f"a page layer of {layer_bytes} bytes cannot be digested: it must be a multiple of 4"
            f" bytes and at most {4 * MAX_LAYER_WORDS}"
        )
    return layer_bytes // 4
