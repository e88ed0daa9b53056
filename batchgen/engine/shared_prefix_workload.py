"""The ``shared-prefix`` trace: families of requests that share prompt prefixes, for prefix caching.

Each request's prompt is one of: a system prompt (three lengths) and a question of its own; the
longest system prompt, a few-shot block and a question; or a whole prompt asked ``n`` times at
once (``n`` > 1 samples). A tenth share nothing. The GPU pool holds about a third of the peak
demand and the host pool little, so shared pages meet eviction, loads and recompute: a victim's
shared pages stay on GPU for the requests still holding them, and its load re-links them.
"""

from __future__ import annotations

import random

from batchgen.config import CacheConfig, EngineConfig, pages_needed
from batchgen.engine.workloads import Workload, WorkloadRequest

SYSTEM_PROMPT_LENGTHS = (13, 30, 61)  # tokens; not page multiples, so last pages stay partial
FEW_SHOT_LENGTH = 40
PAGE_SIZE = 4


def shared_prefix_trace(*, seed: int, scale: float, vocab_size: int) -> Workload:
    """A seeded ``shared-prefix`` workload; ``scale`` grows its requests and pools. Pure."""
    rng = random.Random(f"shared-prefix:{seed}")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab_size) for _ in range(n)]

    systems = [tokens(n) for n in SYSTEM_PROMPT_LENGTHS]
    few_shot = systems[-1] + tokens(FEW_SHOT_LENGTH)
    requests: list[WorkloadRequest] = []
    for i in range(max(8, round(48 * scale))):
        family = rng.random()
        if family < 0.1:
            prompts = [tokens(rng.randint(5, 40))]
        elif family < 0.25:
            prompts = [few_shot + tokens(rng.randint(1, 9))]
        elif family < 0.4:
            prompts = [rng.choice(systems) + tokens(rng.randint(1, 9))] * rng.randint(2, 4)
        else:
            prompts = [rng.choice(systems) + tokens(rng.randint(1, 9))]
        arrival, max_new = (i // 8) * 12 + rng.randint(0, 4), rng.randint(4, 48)
        requests += [
            WorkloadRequest(
                uuid=f"shared-prefix-r{i}" + (f"-{k}" if len(prompts) > 1 else ""),
                prompt_ids=prompt,
                max_new_tokens=max_new,
                arrival_step=arrival,
                temperature=0.0 if len(prompts) == 1 else 0.8,
                seed=k,
            )
            for k, prompt in enumerate(prompts)
        ]
    peak = sum(pages_needed(len(r.prompt_ids) + r.max_new_tokens, PAGE_SIZE) for r in requests)
    cache = CacheConfig(
        page_size=PAGE_SIZE,
        num_gpu_pages=max(64, round(peak * 0.3 / max(1.0, 4 / scale))),
        num_host_pages=max(16, round(peak * 0.06)),
        watermark=0.02,
        enable_prefix_caching=True,
    )
    engine = EngineConfig(max_num_seqs=max(12, round(12 * scale)), max_num_batched_tokens=256)
    return Workload(name="shared-prefix", seed=seed, cache=cache, engine=engine, requests=requests)
