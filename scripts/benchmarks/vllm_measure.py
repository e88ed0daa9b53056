"""How ``bench.py vllm`` measures one mix on both engines, whichever model: the alternating pairs,
the ratio and its spread, the tokens compared, and the matmul ceiling.
"""

from __future__ import annotations

import contextlib
import os
import statistics

import torch

from batchgen.engine.runner import run_workload
from batchgen.state import RequestOutput
from batchgen.validation.hf_oracle import near_tie
from batchgen.validation.output_check import NEAR_TIE_TOLERANCES

from .ab_timer import interleaved, median_ratio, timed_run
from .decode_bound import timed_linears
from .throughput import new_worker
from .vllm_job import VllmRunner, bind_cpus


def summarize(batchgen_walls: list[float], vllm_walls: list[float], num_tokens: int) -> dict:
    """Both engines' median tokens/s over their pairs and vLLM's wall time over batchgen's per
    pair: median, min and max. ValueError when the counts differ. Pure."""
    ratio, ratios = median_ratio(vllm_walls, batchgen_walls)
    return {
        "batchgen_tokens_per_s": num_tokens / statistics.median(batchgen_walls),
        "vllm_tokens_per_s": num_tokens / statistics.median(vllm_walls),
        "ratio": ratio,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def differing_requests(batchgen: list[list[int]], vllm: list[list[int]]) -> int:
    """How many requests got other tokens from the two engines. Pure."""
    return sum(ours != theirs for ours, theirs in zip(batchgen, vllm, strict=True))


def compare_tokens(batchgen: list[RequestOutput], vllm: list[list[int]], tolerance: float) -> dict:
    """How many requests got vLLM's tokens (``equal``), first differ from them at a near-tie
    (vLLM's token batchgen's runner-up there, their log-probabilities within ``tolerance``: the
    project's rule, ``hf_oracle.near_tie``) and otherwise (``differing``). Pure."""
    verdicts = [
        near_tie(theirs, ours, tolerance) for ours, theirs in zip(batchgen, vllm, strict=True)
    ]
    counts = {"equal": verdicts.count(None), "near_tie": verdicts.count(True)}
    counts["differing"] = verdicts.count(False)
    return counts


def alternating_pairs(model, runner: VllmRunner, mix, pairs: int, page_size: int) -> dict:
    """One warm-up run each, then ``pairs`` pairs, the order alternating: each engine's runs, and
    the tokens compared (under the near-tie rule of the model's dtype) on every run."""
    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    with runner.paused():
        first = {"batchgen": run_batchgen_counting(model, mix, page_size)}
    first["vllm"] = runner.run(mix)
    tokens = compare_tokens(
        first["batchgen"]["results"], first["vllm"]["outputs"], NEAR_TIE_TOLERANCES[dtype]
    )

    def run(engine: str) -> dict:
        if engine == "batchgen":
            with runner.paused():
                done = run_batchgen_counting(model, mix, page_size)
        else:
            done = runner.run(mix)
        # each engine's own runs agree with themselves, token for token
        changed = differing_requests(done["outputs"], first[engine]["outputs"])
        tokens["differing"] = max(tokens["differing"], changed)
        return done

    runs = interleaved(("batchgen", "vllm"), pairs, run, rotate=False)
    return {"runs": runs, "tokens": tokens, "num_steps": first["batchgen"]["num_steps"]}


def measure(model, runner: VllmRunner, mix, pairs: int, page_size: int) -> dict:
    """``alternating_pairs``' walls and CPU seconds, their ratios, steps per run, the tokens
    compared, and one more batchgen run with every matmul timed."""
    measured = alternating_pairs(model, runner, mix, pairs, page_size)
    walls = {engine: [run["wall_s"] for run in runs] for engine, runs in measured["runs"].items()}
    cpus = {engine: [run["cpu_s"] for run in runs] for engine, runs in measured["runs"].items()}
    row = summarize(walls["batchgen"], walls["vllm"], mix.num_tokens)
    ratio_cpu, cpu_ratios = median_ratio(cpus["vllm"], cpus["batchgen"])
    row.update(batchgen_cpu_s=cpus["batchgen"], vllm_cpu_s=cpus["vllm"], ratio_cpu=ratio_cpu)
    row.update(ratio_cpu_min=min(cpu_ratios), ratio_cpu_max=max(cpu_ratios))
    # vLLM prefills every prompt of a mix in one step (4096 tokens a step): steps as batchgen's
    steps = measured["num_steps"]
    row.update(batchgen_wall_s=walls["batchgen"], vllm_wall_s=walls["vllm"], num_steps=steps)
    row["batchgen_step_ms"] = 1e3 * statistics.median(walls["batchgen"]) / steps
    row["vllm_step_ms"] = 1e3 * statistics.median(walls["vllm"]) / steps
    tokens = measured["tokens"]
    row.update(num_requests=len(mix.prompts), num_requests_equal=tokens["equal"])
    row["num_requests_near_tie"] = tokens["near_tie"]
    row["num_requests_differing"] = tokens["differing"]
    with runner.paused(), timed_linears(model) as matmul_s:
        run_batchgen_counting(model, mix, page_size)
    row["batchgen_matmul_s"] = matmul_s[0]
    row["ceiling"] = statistics.median(walls["vllm"]) / matmul_s[0]
    return row


def ignoring_eos(worker):
    """``worker`` with no EOS ids: every request runs to its length, as vLLM's with
    ``ignore_eos``. Mutates the worker's model config (its own copy)."""
    worker.model_config = worker.model_config.model_copy(update={"eos_token_ids": ()})
    return worker


def run_batchgen_counting(model, mix, page_size: int) -> dict:
    """batchgen's wall seconds, outputs (and their tokens) per request and steps for ``mix`` on a
    fresh worker with pages of ``page_size`` tokens (its construction not timed), EOS ignored."""
    worker, job = new_worker(model, mix, "cpu", page_size=page_size)
    ignoring_eos(worker)
    timed = timed_run(lambda: run_workload(worker, job))
    results = [timed.result.outputs[f"r{i}"] for i in range(len(mix.prompts))]
    outputs = [list(output.output_ids) for output in results]
    run = dict(wall_s=timed.wall_s, cpu_s=timed.cpu_s, results=results, outputs=outputs)
    run["num_steps"] = timed.result.num_steps
    return run


@contextlib.contextmanager
def bound_to(threads: int):
    """Inside the block, this process on the CPUs vLLM is bound to with ``threads`` threads
    (``bind_cpus``) and torch on ``threads`` threads; its CPUs as they were after it. Mutates this
    process's CPU affinity and torch's thread count."""
    affinity = os.sched_getaffinity(0)
    torch.set_num_threads(threads)
    os.sched_setaffinity(0, {int(cpu) for cpu in bind_cpus(threads).split(",")})
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
