"""What ``batchgen explore`` searches over: seeded workloads drawn from a small parameter space.

A candidate is a dict of parameters (JSON-ready, so a kept one can be mutated and written down)
that :func:`workload_from` turns into a workload file's content: its requests, pools, engine
limits and fault schedule. Every parameter the KV policy's decisions depend on is drawn::

    pools     page size; GPU pages from just enough for the longest request up; host pages from
              0; watermark from {0, 0.02, 0.05, 0.1, 0.25}
    engine    max_num_seqs, the token budget, load retries, the load-failure policy, the load
              timeout
    requests  how many; prompt and output length ranges; arrival waves (size, gap); aborts
    faults    each fault kind on or off, with its probability; a fault seed
"""

from __future__ import annotations

import random

from batchgen.config import CacheConfig, EngineConfig, pages_needed
from batchgen.engine.faults import FaultSpec
from batchgen.engine.workloads import Workload, WorkloadRequest

CHOICES = {
    "num_requests": list(range(2, 25)),
    "page_size": [1, 2, 4, 8, 16],
    "watermark": [0.0, 0.0, 0.02, 0.05, 0.1, 0.25],
    "gpu_slack": list(range(0, 17)),
    "num_host_pages": [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32],
    "max_num_seqs": [1, 2, 3, 4, 6, 8, 16],
    "max_num_batched_tokens": [8, 32, 128, 2048],
    "max_load_retries": [0, 1, 2, 3],
    "load_failure": ["recompute", "fail"],
    "load_timeout_steps": [1, 2, 4, 8],
    "prompt_max": [1, 4, 16, 64],
    "new_max": [1, 2, 8, 32, 64],
    "wave_size": [1, 2, 4, 8, 24],
    "wave_gap": [0, 1, 5, 20],
    "abort_rate": [0.0, 0.0, 0.1, 0.3],
}
FAULT_KINDS = {  # kind -> the probabilities drawn when it is on
    "load_fail": [0.1, 0.3, 0.6],
    "load_fail_late": [0.1, 0.3],
    "load_hang": [0.1, 0.3],
    "slow_store": [0.2],
    "host_shrink": [0.1, 0.3],
    "gpu_refuse": [0.05, 0.2],
    "abort": [0.05, 0.2],
}
_FAULT_ON = 0.25  # chance that a drawn candidate turns a fault kind on


def random_params(rng: random.Random) -> dict:
    """A fresh candidate. Pure but for ``rng``."""
    params = {name: rng.choice(values) for name, values in CHOICES.items()}
    params["seed"] = rng.randrange(2**31)
    params["faults"] = {
        kind: rng.choice(probabilities)
        for kind, probabilities in FAULT_KINDS.items()
        if rng.random() < _FAULT_ON
    }
    return params


def mutate(params: dict, rng: random.Random) -> dict:
    """``params`` with one or two parameters redrawn, a new seed, or a fault kind toggled. Pure but
    for ``rng``."""
    child = {**params, "faults": dict(params["faults"])}
    for _ in range(rng.choice([1, 2])):
        name = rng.choice([*CHOICES, "seed", "faults"])
        if name == "seed":
            child["seed"] = rng.randrange(2**31)
        elif name == "faults":
            kind = rng.choice(list(FAULT_KINDS))
            if child["faults"].pop(kind, None) is None:
                child["faults"][kind] = rng.choice(FAULT_KINDS[kind])
        else:
            child[name] = rng.choice(CHOICES[name])
    return child


def workload_from(params: dict, *, name: str, vocab_size: int) -> Workload:
    """The workload ``params`` describe, token ids drawn from ``[1, vocab_size)``. Pure."""
    rng = random.Random(params["seed"])
    requests = [_request(params, rng, i, vocab_size) for i in range(params["num_requests"])]
    page_size = params["page_size"]
    longest = max(pages_needed(len(r.prompt_ids) + r.max_new_tokens, page_size) for r in requests)
    cache = _cache(params, longest)
    engine = EngineConfig(
        max_num_seqs=params["max_num_seqs"],
        max_num_batched_tokens=params["max_num_batched_tokens"],
        max_load_retries=params["max_load_retries"],
        load_failure=params["load_failure"],
        load_timeout_steps=params["load_timeout_steps"],
    )
    return Workload(
        name=name, seed=params["seed"], cache=cache, engine=engine, requests=requests,
        faults=fault_spec(params),
    )  # fmt: skip


def fault_spec(params: dict) -> str | None:
    """The SPEC of the candidate's faults; None when it has none. Pure."""
    faults = dict(params["faults"])
    load = ("load_fail", "load_fail_late", "load_hang")
    total = sum(faults.get(kind, 0.0) for kind in load)
    if total > 1:  # a load has one outcome: scale them to sum to 1
        faults.update({kind: faults[kind] / total for kind in load if kind in faults})
    if not faults:
        return None
    spec = ",".join([f"seed={params['seed'] % 1000}", *(f"{k}={v:g}" for k, v in faults.items())])
    FaultSpec.parse(spec)
    return spec


def _request(params: dict, rng: random.Random, i: int, vocab_size: int) -> WorkloadRequest:
    prompt = [rng.randrange(1, vocab_size) for _ in range(rng.randint(1, params["prompt_max"]))]
    arrival = (i // params["wave_size"]) * params["wave_gap"] + rng.randint(0, 1)
    abort = rng.randint(0, 12) if rng.random() < params["abort_rate"] else None
    return WorkloadRequest(
        uuid=f"r{i}", prompt_ids=prompt, max_new_tokens=rng.randint(1, params["new_max"]),
        arrival_step=arrival, abort_step=abort,
    )  # fmt: skip


def _cache(params: dict, longest: int) -> CacheConfig:
    """The pools: room for the longest request above the watermark, plus the drawn slack."""
    num_gpu_pages = longest + params["gpu_slack"] + 1
    while True:
        cache = CacheConfig(
            page_size=params["page_size"],
            num_gpu_pages=num_gpu_pages,
            num_host_pages=params["num_host_pages"],
            watermark=params["watermark"],
        )
        if cache.num_gpu_pages - cache.watermark_pages >= longest:
            return cache
        num_gpu_pages += 1
