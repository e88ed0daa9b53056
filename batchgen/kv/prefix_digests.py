"""The prefix cache's page keys: a digest of each full prompt page, chained to the page before.

    digest_0 = blake2b(tokens of page 0)
    digest_i = blake2b(digest_{i-1} || tokens of page i)       tokens as little-endian int32

Two prompts share page i's digest only when their first (i + 1) pages hold the same tokens, so a
page found under a digest holds the K/V of exactly that prefix. The hash is stable across
processes (never Python's ``hash()``): replay, minimize, sweeps and replicas agree on it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16


def prompt_page_digests(prompt_ids: Sequence[int], page_size: int) -> tuple[str, ...]:
    """The hex digest of each full page of ``prompt_ids`` (a partial last page has none). Pure."""
    digests, parent = [], b""
    for start in range(0, len(prompt_ids) - page_size + 1, page_size):
        tokens = array("i", prompt_ids[start : start + page_size]).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=DIGEST_BYTES).digest()
        digests.append(parent.hex())
    return tuple(digests)


def reusable_pages(num_digests: int, num_tokens: int, page_size: int) -> int:
    """How many leading prompt pages a request of ``num_tokens`` may take from the cache: full
    prompt pages, stopping short of its last token, which is always computed (its logits are
    sampled), so no shared page is ever written. Pure."""
    return min(num_digests, (num_tokens - 1) // page_size)


def register_written_pages(gpu_kv, req, start_pos: int, page_size: int) -> None:
    """Index the full prompt pages of ``req`` that K/V written from ``start_pos`` up to its cached
    count just completed, each under its digest (``GpuKvPool.register``: a page or digest indexed
    already is left as it is). Mutates the GPU pool's index."""
    end = min(req.num_cached_tokens, len(req.request.prompt_ids)) // page_size
    for i in range(start_pos // page_size, min(end, len(req.prompt_digests))):
        gpu_kv.register(req.gpu_page_ids[i], req.prompt_digests[i])
