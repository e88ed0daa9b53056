"""The scale check's workload: a pressure trace of anchors that fill the GPU pool and a crowd that
fights over the rest.

``pressure_workload`` builds it (``scale.py``, ``bench.py scale``, explains the run it
serves), ``num_anchors`` says how many of its first requests are anchors, and
``scale_model`` gives the null model a context long enough for every request.

Why anchors: a step evicts only when its decode pages outgrow the pages released by finishes,
and a request releases prompt + output tokens for the output tokens it decoded. Requests short
enough to reach a steady state (memory included) well before step 100 could not fill 1M pages
with prompts and still evict; so anchors hold the pool and a decode-heavy crowd fights over the
rest.
"""

from __future__ import annotations

import math
import random

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig, ModelConfig, pages_needed
from batchgen.engine.workloads import Workload, WorkloadRequest

PAGE_SIZE = 16
WATERMARK = 0.02
OVERCOMMIT = 1.2  # crowd demand / GPU pages the anchors leave
PROMPT_TOKENS = (1, 8)  # crowd requests, inclusive ranges
NEW_TOKENS = (16, 80)
ANCHOR_NEW_TOKENS = 100_000  # longer than any run: anchors hold their pages throughout


def num_anchors(num_requests: int) -> int:
    """Long-context requests in a workload of ``num_requests``: the first ones, 1 in 256."""
    return max(1, num_requests // 256)


def pressure_workload(
    num_requests: int, num_gpu_pages: int, *, seed: int = 0, vocab_size: int = 512
) -> Workload:
    """``num_requests`` requests at step 0: a few anchors that fill the GPU pool, and a crowd.

    ::

        GPU pool  [ anchors: long prompts, never finish ........ | crowd room | watermark ]
        crowd     prompts 1-8 tokens, outputs 16-80: asks for 1.2x the crowd room
        host pool num_gpu_pages // 1000 pages

    The crowd room is sized from the crowd's time-averaged page demand; anchors share one
    prompt (why anchors: the module docstring).
    """
    rng, n_anchors, crowd = _crowd(num_requests, seed)
    usable = _usable_pages(num_gpu_pages)
    anchor_pages = _anchor_pages(crowd, usable, n_anchors, num_gpu_pages)
    tokens = [rng.randrange(1, vocab_size) for _ in range(anchor_pages * PAGE_SIZE)]
    anchor_new = min(ANCHOR_NEW_TOKENS, (usable - anchor_pages) * PAGE_SIZE)
    requests = [
        WorkloadRequest(uuid=f"s{i}.g0", prompt_ids=tokens, max_new_tokens=anchor_new)
        for i in range(n_anchors)
    ]
    for i, (prompt_len, max_new) in enumerate(crowd, start=n_anchors):
        start = rng.randrange(len(tokens) - prompt_len)
        requests.append(
            WorkloadRequest(
                uuid=f"s{i}.g0",
                prompt_ids=tokens[start : start + prompt_len],
                max_new_tokens=max_new,
            )
        )
    cache = CacheConfig(
        page_size=PAGE_SIZE,
        num_gpu_pages=num_gpu_pages,
        num_host_pages=num_gpu_pages // 1000,
        watermark=WATERMARK,
    )
    engine = EngineConfig(
        max_num_seqs=num_requests,
        # step 0 admits all
        max_num_batched_tokens=sum(len(r.prompt_ids) for r in requests),
    )
    return Workload(
        name=f"scale-{num_requests}x{num_gpu_pages}",
        seed=seed,
        cache=cache,
        engine=engine,
        requests=requests,
    )


def check_fits(num_requests: int, num_gpu_pages: int, *, seed: int = 0) -> None:
    """ValueError when :func:`pressure_workload` would refuse these sizes (its anchors get no page),
    without building the requests. Pure."""
    _, n_anchors, crowd = _crowd(num_requests, seed)
    _anchor_pages(crowd, _usable_pages(num_gpu_pages), n_anchors, num_gpu_pages)


def _crowd(num_requests: int, seed: int) -> tuple[random.Random, int, list[tuple[int, int]]]:
    """The workload's seeded generator (as the crowd leaves it), the anchor count, and the crowd's
    (prompt tokens, new tokens) pairs."""
    rng = random.Random(f"scale:{seed}")
    n_anchors = num_anchors(num_requests)
    return (
        rng,
        n_anchors,
        [
            (rng.randint(*PROMPT_TOKENS), rng.randint(*NEW_TOKENS))
            for _ in range(num_requests - n_anchors)
        ],
    )


def _usable_pages(num_gpu_pages: int) -> int:
    return num_gpu_pages - math.ceil(WATERMARK * num_gpu_pages)


def _anchor_pages(
    crowd: list[tuple[int, int]], usable: int, n_anchors: int, num_gpu_pages: int
) -> int:
    """GPU pages each anchor's prompt fills: the usable pages less the crowd's room; ValueError when
    none is left."""
    # time-averaged pages of a crowd slot: each template weighted by how long it lives
    slot_pages = sum(
        pages_needed(p + age + 1, PAGE_SIZE) for p, new in crowd for age in range(new)
    ) / sum(n for _, n in crowd)
    anchor_pages = (usable - round(len(crowd) * slot_pages / OVERCOMMIT)) // n_anchors
    if anchor_pages < 1:
        raise ValueError(
            f"{num_gpu_pages} GPU pages cannot hold the crowd of {len(crowd)} requests "
            f"({len(crowd) * slot_pages:.0f} pages); give more pages or fewer requests"
        )
    return anchor_pages


def scale_model(workload: Workload, vocab_size: int = 512) -> ModelConfig:
    """The tiny model's geometry with a context long enough for every request."""
    context = 1 << (workload.max_context - 1).bit_length()
    return TINY_MODELS["tiny"].model_copy(update={"vocab_size": vocab_size, "max_context": context})
