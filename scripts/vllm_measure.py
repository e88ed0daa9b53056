"""How ``bench_vllm.py`` measures one mix on both engines, whichever model: the alternating pairs,
the ratio and its spread, the tokens compared, and the matmul ceiling.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch
from bench_throughput import new_worker
from decode_bound import timed_linears
from vllm_job import VllmRunner, bind_cpus

from batchgen.engine.runner import run_workload
from batchgen.state import RequestOutput
from batchgen.validation.hf_oracle import near_tie
from batchgen.validation.output_check import NEAR_TIE_TOLERANCES


def summarize(batchgen_walls: list[float], vllm_walls: list[float], num_tokens: int) -> dict:
    """Both engines' median tokens/s over their pairs and vLLM's wall time over batchgen's per
    pair: median, min and max. Pure."""
    ratios = pair_ratios(batchgen_walls, vllm_walls)
    return {
        "batchgen_tokens_per_s": num_tokens / statistics.median(batchgen_walls),
        "vllm_tokens_per_s": num_tokens / statistics.median(vllm_walls),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def pair_ratios(batchgen: list[float], vllm: list[float]) -> list[float]:
    """vLLM's figure over batchgen's, pair by pair. Pure."""
    return [v / b for b, v in zip(batchgen, vllm, strict=True)]


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


def measure(model, runner: VllmRunner, mix, pairs: int, page_size: int) -> dict:
    """One warm-up run each, then ``pairs`` alternating pairs; walls, tokens compared on every
    run (under the near-tie rule of the model's dtype), steps per run, and one more batchgen run
    with every matmul timed."""
    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    tolerance = NEAR_TIE_TOLERANCES[dtype]
    with runner.paused():
        batchgen = run_batchgen_counting(model, mix, page_size)
    vllm = runner.run(mix)
    tokens = compare_tokens(batchgen["results"], vllm["outputs"], tolerance)
    walls, cpus = {"batchgen": [], "vllm": []}, {"batchgen": [], "vllm": []}
    for pair in range(pairs):
        for engine in ("batchgen", "vllm") if pair % 2 == 0 else ("vllm", "batchgen"):
            if engine == "batchgen":
                with runner.paused():
                    run = run_batchgen_counting(model, mix, page_size)
                # each engine's own runs agree with themselves, token for token
                changed = differing_requests(run["outputs"], batchgen["outputs"])
            else:
                run = runner.run(mix)
                changed = differing_requests(run["outputs"], vllm["outputs"])
            walls[engine].append(run["wall_s"])
            cpus[engine].append(run["cpu_s"])
            tokens["differing"] = max(tokens["differing"], changed)
    row = summarize(walls["batchgen"], walls["vllm"], mix.num_tokens)
    cpu_ratios = pair_ratios(cpus["batchgen"], cpus["vllm"])
    row.update(batchgen_cpu_s=cpus["batchgen"], vllm_cpu_s=cpus["vllm"])
    row.update(ratio_cpu=statistics.median(cpu_ratios), ratio_cpu_min=min(cpu_ratios))
    row["ratio_cpu_max"] = max(cpu_ratios)
    # vLLM prefills every prompt of a mix in one step (4096 tokens a step): steps as batchgen's
    steps = batchgen["num_steps"]
    row.update(batchgen_wall_s=walls["batchgen"], vllm_wall_s=walls["vllm"], num_steps=steps)
    row["batchgen_step_ms"] = 1e3 * statistics.median(walls["batchgen"]) / steps
    row["vllm_step_ms"] = 1e3 * statistics.median(walls["vllm"]) / steps
    row["num_requests"] = len(mix.prompts)
    row["num_requests_equal"] = tokens["equal"]
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
    started, cpu = time.perf_counter(), time.process_time()
    result = run_workload(worker, job)
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    results = [result.outputs[f"r{i}"] for i in range(len(mix.prompts))]
    outputs = [list(output.output_ids) for output in results]
    run = dict(wall_s=wall_s, cpu_s=cpu_s, results=results, outputs=outputs)
    run["num_steps"] = result.num_steps
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
