"""Prefix caching on the real model: batchgen against vLLM's CPU backend, each with its prefix
cache off and on.

Two jobs (``prefix_jobs``): ``shared``, ``--lines`` chat lines through the model's chat template
sharing ``--shared-tokens`` tokens (the template's head, a ~500-token system prompt, the head of
the user turn) before a short question of their own, and ``unique``, the same lengths drawn at
random (nothing shared); ``--new-tokens`` each, greedy, ``ignore_eos``, ``--max-num-seqs`` at a
time, both engines on the same ``--threads`` CPUs with KV pages of ``--page-size`` tokens and a
step's budget that admits every line running at once. The cells: batchgen off and on and vLLM off
and on for ``shared``, batchgen off and on for ``unique`` (vLLM too with ``--vllm-unique``). vLLM
runs in its own venv (``vllm_venv``), one runner process per switch (``enable_prefix_caching``
on its LLM; the one with it on empties its cache before each run), stopped while any other cell
runs. After a warm-up run each (two lines), the cells run ``--pairs`` times in turn (the order
rotated each round: the shared A/B timer); each ratio is the median over rounds of that round's
ratio, printed with its spread. Tokens are compared on the first round, and every later run's
against its cell's first.

    caching speeds      off wall over on wall, per engine and job
    against vLLM        vLLM's wall over batchgen's, caching on and off
    prefill computed    batchgen: tokens given to the model, less the decode tokens; vLLM: prompt
                        tokens less those its outputs report cached (``num_cached_tokens``)
    ceiling             vLLM-on's wall over the seconds one more batchgen-on run spent in matmuls

Goals: caching on computes only the unique share (one line's whole prompt, the rest past their
cached pages); on ``shared`` caching speeds batchgen at least as much as vLLM; batchgen on at
least 1.25x vLLM on, or, where the ceiling is below 1.25x, at least batchgen off's ratio to vLLM
off; on ``unique``, on and off within 2%. Exit 1 when caching changes batchgen's tokens (not at
a near-tie).

    python scripts/bench.py prefix --lines 32 --pairs 1
    python scripts/bench.py prefix --pairs 3 --json-out prefix.json --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console

from batchgen.engine.host_malloc import keep_freed_memory
from batchgen.model.loader import load_model
from batchgen.validation.hf_reference import reference_directory

from .ab_timer import interleaved
from .decode_bound import timed_linears
from .output_path import output_path, write_output
from .prefix_jobs import at_once_mix, at_once_tokens, run_batchgen, shared_job, unique_job
from .prefix_report import check_tokens, render, summarize, verdicts
from .throughput import Mix
from .vllm_job import VllmRunner
from .vllm_measure import bound_to
from .vllm_real import kv_cache_gib
from .vllm_venv import DEFAULT_VENV, ensure_venv

WARM_UP_LINES = 2  # each cell's untimed warm-up: the first lines of its job


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--lines", type=int, default=256, help="chat lines per job (default %(default)s)")
    add("--new-tokens", type=int, default=64, help="per line (default %(default)s)")
    add("--threads", type=int, default=1, help="CPUs and threads, both engines (default 1)")
    add("--pairs", type=int, default=3, help="rounds of every cell after the warm-up (default 3)")
    add("--max-num-seqs", type=int, default=64, help="lines at a time (default %(default)s)")
    add("--shared-tokens", type=int, default=512, help="tokens every shared line shares (512)")
    add("--page-size", type=int, default=128, help="KV page tokens, both engines (128: vLLM's)")
    add("--seed", type=int, default=0, help="the unique job's tokens (default 0)")
    add("--model", type=Path, help="HF directory with a chat template (default SmolLM2-135M's)")
    add("--no-vllm", action="store_true", help="batchgen's cells only (no vLLM venv needed)")
    add("--vllm-unique", action="store_true", help="vLLM's cells of the unique job too")
    add("--venv", type=Path, default=DEFAULT_VENV, help=f"vLLM's (default {DEFAULT_VENV})")
    add("--json-out", type=output_path, help="write every sample and figure as JSON here")
    add("--markdown", action="store_true", help="print the tables as Markdown")
    return parser


def parse_args(argv: list[str], prog: str = "bench.py prefix") -> argparse.Namespace:
    """The command line, checked; SystemExit naming what is wrong."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    num_cpus = len(os.sched_getaffinity(0))
    if args.lines < 2:
        parser.error(f"--lines needs >= 2 (lines that share a prefix), got {args.lines}")
    if min(args.new_tokens, args.pairs, args.max_num_seqs, args.shared_tokens) < 1:
        parser.error("--new-tokens, --pairs, --max-num-seqs and --shared-tokens need >= 1")
    if not 1 <= args.threads <= num_cpus:
        parser.error(f"--threads takes 1..{num_cpus} (this machine's CPUs), got {args.threads}")
    if args.page_size < 32 or args.page_size % 32:
        parser.error(
            f"--page-size takes a multiple of 32 (vLLM's CPU blocks), got {args.page_size}"
        )
    if args.shared_tokens < args.page_size:
        parser.error(
            f"--shared-tokens {args.shared_tokens} is under one page of {args.page_size}: no"
            " page would be shared"
        )
    if args.no_vllm and args.vllm_unique:
        parser.error("--vllm-unique needs vLLM: leave out --no-vllm")
    return args


def cell_names(args: argparse.Namespace) -> list[str]:
    """The cells measured, ``JOB ENGINE SWITCH``. Pure."""
    engines = [("shared", "batchgen")] + ([] if args.no_vllm else [("shared", "vllm")])
    engines += [("unique", "batchgen")] + ([("unique", "vllm")] if args.vllm_unique else [])
    return [f"{job} {engine} {switch}" for job, engine in engines for switch in ("off", "on")]


def start_runners(args, model_dir: str, jobs: dict, model, stack) -> dict:
    """vLLM's runner for each switch (none with ``--no-vllm``), closed by ``stack``; each loads the
    model once. Mutates ``stack``."""
    if args.no_vllm:
        return {}
    log = Path(tempfile.gettempdir()) / "bench_prefix.log"
    python = ensure_venv(args.venv, log)
    shared = jobs["shared"]
    held = at_once_mix(shared)
    longest = max(len(p) + n for job in jobs.values() for p, n in zip(job.prompts, job.new_tokens))
    settings = dict(dtype="float32", batched_tokens=at_once_tokens(shared), max_model_len=longest)
    settings["kv_cache_gib"] = kv_cache_gib(held, model.config, "float32", args.page_size)
    runners = {}
    for switch in ("off", "on"):
        workdir = stack.enter_context(tempfile.TemporaryDirectory())
        caching = switch == "on"
        runner = VllmRunner(
            python,
            model_dir,
            shared,
            args.threads,
            args.page_size,
            log,
            workdir=workdir,
            prefix_caching=caching,
            **settings,
        )
        stack.callback(runner.close)
        runners[switch] = runner
    return runners


def paused(runners: dict, keep: str | None = None):
    """Every runner but ``keep``'s stopped inside the block (``VllmRunner.paused``)."""
    stack = contextlib.ExitStack()
    for switch, runner in runners.items():
        if switch != keep:
            stack.enter_context(runner.paused())
    return stack


def run_cell(cell: str, model, jobs: dict, runners: dict, page_size: int) -> dict:
    """One run of ``cell``: wall and CPU seconds, outputs, prefill tokens computed (and, for
    batchgen, its results and the prefix cache's hit tokens)."""
    job, engine, switch = cell.split()
    mix = jobs[job]
    if engine == "batchgen":
        with paused(runners):
            return run_batchgen(model, mix, page_size, caching=switch == "on")
    with paused(runners, keep=switch):
        run = runners[switch].run(mix)
    cached = sum(run["cached_tokens"])
    run.update(prefill_tokens=sum(map(len, mix.prompts)) - cached, hit_tokens=cached)
    return run


def warm_up_job(job: Mix) -> Mix:
    """The first ``WARM_UP_LINES`` lines of ``job``. Pure."""
    lines = slice(WARM_UP_LINES)
    return replace(job, prompts=job.prompts[lines], new_tokens=job.new_tokens[lines])


def measure(args, model, jobs: dict, runners: dict, console: Console) -> dict:
    """Every cell's warm-up run (its job's first ``WARM_UP_LINES`` lines), then ``--pairs`` rounds
    in turn, then the matmul-timed run: each cell's runs, its first, and the matmul seconds."""
    cells = cell_names(args)
    warm = {name: warm_up_job(job) for name, job in jobs.items()}
    for cell in cells:
        run_cell(cell, model, warm, runners, args.page_size)

    def run(cell: str) -> dict:
        done = run_cell(cell, model, jobs, runners, args.page_size)
        done["load"] = os.getloadavg()[0]  # the machine's, other jobs' included
        console.print(f"{cell}: {done['wall_s']:.1f} s, load {done['load']:.1f}", highlight=False)
        return done

    runs = interleaved(cells, args.pairs, run)
    first = {cell: cell_runs[0] for cell, cell_runs in runs.items()}
    matmul_s = [None]
    if runners:  # the ceiling's: vLLM-on's wall over it
        with paused(runners), timed_linears(model) as matmul_s:
            run_batchgen(model, jobs["shared"], args.page_size, caching=True)
    return dict(first=first, runs=runs, matmul_s=matmul_s[0])


def main(argv: list[str], prog: str) -> int:
    args = parse_args(argv, prog)
    console = Console(width=200 if args.markdown else 160)
    keep_freed_memory()  # batchgen's allocator as its command line sets it (``vllm_bench``)
    model_dir = str(args.model or reference_directory())
    from transformers import AutoTokenizer  # only here: the parser's refusals stay fast

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir)
    shared = shared_job(
        tokenizer, args.lines, args.shared_tokens, args.new_tokens, args.max_num_seqs
    )
    unique = unique_job(shared, tokenizer, model.config.vocab_size, args.seed)
    jobs = dict(shared=shared, unique=unique)
    with contextlib.ExitStack() as stack:
        runners = start_runners(args, model_dir, jobs, model, stack)
        with bound_to(args.threads):
            measured = measure(args, model, jobs, runners, console)
    loads = [run["load"] for runs in measured["runs"].values() for run in runs]
    tokens = check_tokens(measured["first"], measured["runs"])
    summary = summarize(measured, jobs, args.page_size, args.shared_tokens)
    goals = verdicts(summary)
    for table in render(summary, tokens, goals, args.markdown):
        console.print(table)
    load = f"{min(loads):.1f}-{max(loads):.1f}"
    console.print(f"1-minute load average after each timed run: {load}", highlight=False)
    if args.json_out:
        record = {"args": {k: str(v) for k, v in vars(args).items() if k != "json_out"}}
        record.update(torch=torch.__version__, python=sys.version.split()[0])
        record.update(summary=summary, tokens=tokens, goals=goals)
        record["runs"] = {cell: strip(runs) for cell, runs in measured["runs"].items()}
        write_output(args.json_out, json.dumps(record, indent=2) + "\n")
    if tokens["batchgen on vs off"]["differing"]:
        raise SystemExit("prefix caching changed batchgen's tokens (not at a near-tie)")
    return 0


def strip(runs: list[dict]) -> list[dict]:
    """The runs' figures without their outputs (JSON stays small). Pure."""
    return [
        {key: run[key] for key in ("wall_s", "cpu_s", "prefill_tokens", "hit_tokens", "load")}
        for run in runs
    ]
