"""The vLLM side of ``bench.py vllm``, run by the python of vLLM's own venv (never batchgen's).

    python vllm_runner.py JOB.json

The job names the checkpoint directory and the engine's settings. The runner builds one
``vllm.LLM`` from it, writes ``{"ready": true}``, then reads one JSON line per run from stdin
(``{"prompts": [[ids...]], "new_tokens": [n...]}``) and writes one JSON line back per run: its
wall and CPU seconds (its own and its engine processes'), every request's output token ids,
greedy, ``ignore_eos``, and its prompt tokens taken from the prefix cache (``cached_tokens``; with
the job's ``enable_prefix_caching`` the cache is emptied before each run, untimed). An empty line
or end of input ends it. The runner first confines itself to the job's ``cpus``, so vLLM's every
process (its front end and engine core, not only its compute threads) runs on the CPUs batchgen
is given. Results go to the runner's
original standard output; everything else (vLLM's logs, its engine process's) goes to standard
error.

    python vllm_runner.py --first-token MODEL DTYPE CPUS PROMPT

builds ``vllm.LLM(MODEL)`` (its defaults but ``DTYPE``) on the CPUs ``CPUS`` (a comma list), sends
one chat message of ``PROMPT``, greedy, one new token, and writes one JSON line, that token's id,
as it comes (``vllm_ttft.py`` times it).
"""

from __future__ import annotations

import json
import os
import sys
import time

JOB_KEYS = (
    "checkpoint",
    "max_num_seqs",
    "max_model_len",
    "max_num_batched_tokens",
    "dtype",
    "cpus",
)


def read_job(path: str) -> dict:
    """The job file's settings; ValueError naming the keys it lacks. Pure read."""
    with open(path) as file:
        job = json.load(file)
    missing = [key for key in JOB_KEYS if key not in job]
    if missing:
        raise ValueError(f"{path}: job lacks {', '.join(missing)} (needs {', '.join(JOB_KEYS)})")
    return job


def build_llm(job: dict):
    """One ``vllm.LLM`` over the job's checkpoint (its tokenizer beside it), offline."""
    from vllm import LLM

    return LLM(
        model=job["checkpoint"],
        dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"],
        max_model_len=job["max_model_len"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        seed=0,
        **job.get("engine_args", {}),
    )


def start_engine(path: str):
    """The LLM of the job at ``path``, built once this process is confined to the job's CPUs,
    so every process vLLM starts inherits them. Mutates this process's CPU affinity."""
    job = read_job(path)
    os.sched_setaffinity(0, job["cpus"])
    return build_llm(job)


def generate(llm, prompts: list[list[int]], new_tokens: list[int]) -> dict:
    """Every request's greedy tokens (request order) and the run's wall seconds."""
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in new_tokens
    ]
    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    started, cpu = time.perf_counter(), cpu_seconds()
    outputs = llm.generate(requests, params, use_tqdm=False)
    wall_s, cpu_s = time.perf_counter() - started, cpu_seconds() - cpu
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    cached = [out.num_cached_tokens or 0 for out in outputs]
    return {"wall_s": wall_s, "cpu_s": cpu_s, "outputs": tokens, "cached_tokens": cached}


def empty_prefix_cache(llm) -> None:
    """Drop every cached block of ``llm`` (a run must not hit the one before); RuntimeError when
    vLLM refuses (blocks still held). Mutates the engine's prefix cache."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM could not empty its prefix cache (blocks still held)")


def cpu_seconds() -> float:
    """CPU seconds used so far by this process and its live children (vLLM's engine core and its
    worker): on a loaded machine a multi-process engine gets more CPU than its wall time shows."""
    import psutil

    me = psutil.Process()
    return sum(sum(proc.cpu_times()[:2]) for proc in [me, *me.children(recursive=True)])


def first_token(model: str, dtype: str, cpus: list[int], prompt: str) -> dict:
    """One chat message's first token from a fresh ``vllm.LLM`` of ``model`` (its defaults but
    ``dtype``), built once this process is confined to ``cpus``. Mutates this process's CPU
    affinity."""
    os.sched_setaffinity(0, cpus)
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    outputs = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
    return {"token_ids": list(outputs[0].outputs[0].token_ids)}


def main() -> None:
    results = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM's prints, and its children's
    if sys.argv[1] == "--first-token":
        model, dtype, cpus, prompt = sys.argv[2:]
        token = first_token(model, dtype, [int(cpu) for cpu in cpus.split(",")], prompt)
        results.write(json.dumps(token) + "\n")
        return
    llm = start_engine(sys.argv[1])
    caching = read_job(sys.argv[1]).get("engine_args", {}).get("enable_prefix_caching", False)
    results.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            break
        run = json.loads(line)
        if caching:
            empty_prefix_cache(llm)
        results.write(json.dumps(generate(llm, run["prompts"], run["new_tokens"])) + "\n")


if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this module
    main()
