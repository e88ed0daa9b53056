"""Engine throughput: batchgen's continuous batching against HF transformers ``generate``.

Both systems run the same HF Llama checkpoint (seeded random weights, saved by HF
to a temporary directory and loaded by batchgen from it) on the same prompts,
greedy, in one process on ``--threads`` torch threads. The two are interleaved
``--repeats`` times; each system's figure is its fastest repeat (minimum wall
time; the minimum CPU time is shown beside it). Two mixes:

    static  32 requests, prompts of 16-128 tokens, 64 new tokens each, all at step 0.
            HF: one left-padded batch (its best case).
    mixed   64 requests, prompts of 16-128 tokens, 16-256 new tokens, at most
            --max-num-seqs (16) at a time. HF: consecutive static batches of 16 in
            arrival order, each until its longest request ends; batchgen: continuous
            batching, under each admission order (``schedule_policy``): fcfs, oldest first
            (the default), and lof, longest output first. Only requested tokens count.

batchgen runs the workload through ``run_workload`` on a fresh ``Worker`` (what
``batchgen run`` does), with pools that never evict, in the model's dtype. Each
request's tokens are checked against HF's: a request whose first differing token
is a near-tie (HF's token is batchgen's runner-up there, the log-probabilities
within the validation's tolerance: rounding decides) is counted apart. In float32
the run fails (exit 1) when any other request differs; in bfloat16 the table only
counts them (two kernels' roundings differ more).

With ``--device cuda`` the default geometry is Llama-3.2-1B's (bfloat16), and a
decode-only run of the static mix reports batchgen's median decode step time
against the memory-bandwidth bound of reading every weight and the KV once per
step, at the device-to-device copy bandwidth measured in the same run.

    python scripts/bench.py throughput --json-out bench_throughput.json
    python scripts/bench.py throughput --device cuda
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from dataclasses import dataclass

import torch
import transformers
from rich.console import Console
from rich.table import Table

from batchgen.config import CacheConfig, EngineConfig, pages_needed
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest
from batchgen.model.loader import load_model
from batchgen.state import RequestOutput
from batchgen.validation.hf_oracle import near_tie
from batchgen.validation.output_check import NEAR_TIE_TOLERANCES

from .ab_timer import Timed, interleaved, timed_run
from .decode_bound import decode_steps
from .hf_checkpoint import hf_generate, save_checkpoint
from .output_path import write_output
from .throughput_args import parse_args, split

PAGE_SIZE = 16


@dataclass(frozen=True, slots=True)
class Mix:
    """The requests of one mix and how many run at a time (``max_num_seqs``)."""

    name: str
    prompts: list[list[int]]
    new_tokens: list[int]
    max_num_seqs: int
    schedule_policies: tuple[str, ...]  # batchgen runs the mix under each

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)


def build_mixes(args: argparse.Namespace, vocab_size: int) -> list[Mix]:
    """The seeded requests of each mix in ``--mixes``. Pure."""
    rng = random.Random(args.seed)

    def prompts(count: int) -> list[list[int]]:
        lengths = [rng.randint(*args.prompt_range) for _ in range(count)]
        return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]

    mixes = {
        "static": Mix(
            "static",
            prompts(args.static_requests),
            [args.static_new_tokens] * args.static_requests,
            args.static_requests,
            ("fcfs",),  # equal lengths: lof admits in the same order
        ),
        "mixed": Mix(
            "mixed",
            prompts(args.mixed_requests),
            [rng.randint(*args.mixed_range) for _ in range(args.mixed_requests)],
            args.max_num_seqs,
            ("fcfs", "lof"),
        ),
    }
    return [mixes[name] for name in split(args.mixes)]


def batched_tokens(mix: Mix) -> int:
    """A step's token budget that admits every prompt of ``mix`` at once. Pure."""
    return sum(map(len, mix.prompts)) + len(mix.prompts)


def workload(mix: Mix, dtype: str, schedule_policy: str, page_size: int = PAGE_SIZE) -> Workload:
    """The mix as a batchgen workload, all at step 0, with ``dtype`` pools of ``page_size`` slots a
    page that hold every request. Pure."""
    requests = [
        WorkloadRequest(uuid=f"r{i}", prompt_ids=prompt, max_new_tokens=num_new)
        for i, (prompt, num_new) in enumerate(zip(mix.prompts, mix.new_tokens))
    ]
    num_pages = sum(
        pages_needed(len(p) + n, page_size) for p, n in zip(mix.prompts, mix.new_tokens)
    )
    return Workload(
        name=mix.name,
        cache=CacheConfig(
            page_size=page_size,
            num_gpu_pages=num_pages + 1,
            num_host_pages=0,
            dtype=dtype,
            watermark=0.0,
        ),
        engine=EngineConfig(
            max_num_seqs=mix.max_num_seqs,
            max_num_batched_tokens=batched_tokens(mix),
            schedule_policy=schedule_policy,
        ),
        requests=requests,
    )


def new_worker(
    model, mix: Mix, device: str, schedule_policy: str = "fcfs", page_size: int = PAGE_SIZE
) -> tuple[Worker, Workload]:
    """A worker for ``mix`` whose KV pages have the model's dtype and ``page_size`` slots, and the
    workload."""
    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    job = workload(mix, dtype, schedule_policy, page_size)
    worker = Worker(
        model,
        cache_config=job.cache,
        engine_config=job.engine,
        device=device,
    )
    return worker, job


def run_batchgen(model, mix: Mix, device: str, schedule_policy: str) -> Timed:
    """batchgen's output of every request (request order) from a fresh worker, timed without the
    worker's construction (its pools)."""
    worker, job = new_worker(model, mix, device, schedule_policy)

    def generate() -> list[RequestOutput]:
        result = run_workload(worker, job)
        return [result.outputs[f"r{i}"] for i in range(len(mix.prompts))]

    return timed_run(generate, cuda=device == "cuda")


def measure(hf_model, model, mix: Mix, args: argparse.Namespace) -> list[dict]:
    """HF and batchgen under each of the mix's schedule policies, interleaved ``--repeats`` times
    after one warm-up each; one row per policy, HF's timings in each."""

    def hf_run() -> list[list[int]]:
        return hf_generate(hf_model, mix.prompts, mix.new_tokens, mix.max_num_seqs, args.device)

    runs = {"hf": lambda: timed_run(hf_run, cuda=args.device == "cuda")}
    for policy in mix.schedule_policies:
        runs[policy] = lambda policy=policy: run_batchgen(model, mix, args.device, policy)
    outputs = {name: run().result for name, run in runs.items()}  # warm-up
    samples = interleaved(sorted(runs), args.repeats, lambda name: runs[name](), rotate=False)
    tolerance = NEAR_TIE_TOLERANCES[args.dtype]
    rows = []
    for policy in mix.schedule_policies:
        row = {"mix": mix.name, "schedule_policy": policy, "num_requests": len(mix.prompts)}
        row["num_tokens"] = mix.num_tokens
        for name, system in (("hf", "hf"), (policy, "batchgen")):
            row[f"{system}_wall_s"] = [t.wall_s for t in samples[name]]
            row[f"{system}_cpu_s"] = [t.cpu_s for t in samples[name]]
            row[f"{system}_tokens_per_s"] = mix.num_tokens / min(row[f"{system}_wall_s"])
        row["ratio_wall"] = min(row["hf_wall_s"]) / min(row["batchgen_wall_s"])
        row["ratio_cpu"] = min(row["hf_cpu_s"]) / min(row["batchgen_cpu_s"])
        near_ties = [
            near_tie(hf, ours, tolerance) for hf, ours in zip(outputs["hf"], outputs[policy])
        ]
        row["num_requests_near_tie"] = near_ties.count(True)
        row["num_requests_differing"] = near_ties.count(False)
        rows.append(row)
    return rows


def render(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    columns = ("geometry", "mix", "admission", "tokens", "batchgen tok/s", "HF tok/s", "ratio")
    for column in (*columns, "ratio CPU", "tokens as HF"):
        left = column in ("geometry", "mix", "admission")
        table.add_column(column, justify="left" if left else "right")
    for row in rows:
        table.add_row(
            row["geometry"],
            row["mix"],
            row["schedule_policy"],
            str(row["num_tokens"]),
            f"{row['batchgen_tokens_per_s']:.1f}",
            f"{row['hf_tokens_per_s']:.1f}",
            f"{row['ratio_wall']:.2f}x",
            f"{row['ratio_cpu']:.2f}x",
            tokens_as_hf(row),
        )
    return table


def tokens_as_hf(row: dict) -> str:
    """ "all", or how many requests differ from HF first at a near-tie, and otherwise. Pure."""
    counts = [(row["num_requests_near_tie"], "near-tie"), (row["num_requests_differing"], "differ")]
    return ", ".join(f"{n} {what}" for n, what in counts if n) or "all"


def main(argv: list[str], prog: str) -> int:
    args = parse_args(argv, prog, __doc__.split("\n\n")[0])
    torch.set_num_threads(args.threads)
    console = Console()
    dtype = getattr(torch, args.dtype)
    rows, decode = [], {}
    for name, geometry in args.geometries.items():
        with tempfile.TemporaryDirectory() as checkpoint:
            hf_model = save_checkpoint(checkpoint, geometry, args.seed, dtype).to(args.device)
            model = load_model(checkpoint, device=args.device, dtype=args.dtype)
        mixes = build_mixes(args, geometry["vocab_size"])
        for mix in mixes:
            for row in measure(hf_model, model, mix, args):
                rows.append({"geometry": name, **row})
                console.print(
                    f"{name} {mix.name} {row['schedule_policy']}: {row['ratio_wall']:.2f}x HF"
                )
        if args.device == "cuda":
            static = next((mix for mix in mixes if mix.name == "static"), mixes[0])
            worker, job = new_worker(model, static, args.device)
            decode[name] = decode_steps(model, worker, job, args.device)
            console.print(f"{name} decode: {decode[name]}")
        del hf_model, model
    title = (
        f"batchgen vs HF generate, {args.device}, {args.threads} thread(s), {args.dtype}, best of"
        f" {args.repeats}"
    )
    console.print(render(rows, title))
    differing = sum(row["num_requests_differing"] for row in rows)
    if args.json_out:
        record = {"args": {k: v for k, v in vars(args).items() if k != "json_out"}}
        record.update(torch=torch.__version__, transformers=transformers.__version__)
        record.update(rows=rows, decode=decode)
        write_output(args.json_out, json.dumps(record, indent=2, default=str) + "\n")
    if differing and args.dtype == "float32":
        raise SystemExit(
            f"{differing} request(s) got tokens that differ from HF greedy, not at a near-tie"
        )
    return 0
