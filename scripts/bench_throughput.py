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

    python scripts/bench_throughput.py --json-out bench_throughput.json
    python scripts/bench_throughput.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import transformers
from output_path import output_path, write_output
from rich.console import Console
from rich.table import Table

from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.runner import run_workload
from batchgen.engine.state import RequestOutput
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.output_check import NEAR_TIE_TOLERANCES

PAGE_SIZE = 16
# name -> HF LlamaConfig keys; "HxL" names a CPU geometry (head_dim 64, 2 query heads per KV head)
NAMED_GEOMETRIES = {
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
    ),
}


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Both systems are measured interleaved in one run; compare ratios.",
    )
    parser.add_argument(
        "--geometry",
        default=None,
        help=(
            "comma list of HxL (hidden size x layers, e.g. 256x4) or llama-1b "
            "(default: 256x4,512x8 on cpu, llama-1b on cuda)"
        ),
    )
    parser.add_argument("--vocab-size", type=int, default=32000, help="for HxL (default 32000)")
    parser.add_argument("--mixes", default="static,mixed", help="comma list (default both)")
    parser.add_argument("--static-requests", type=int, default=32, help="(default 32)")
    parser.add_argument("--static-new-tokens", type=int, default=64, help="(default 64)")
    parser.add_argument("--mixed-requests", type=int, default=64, help="(default 64)")
    parser.add_argument(
        "--mixed-new-tokens", default="16,256", help="MIN,MAX new tokens (default 16,256)"
    )
    parser.add_argument("--prompt-tokens", default="16,128", help="MIN,MAX (default 16,128)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="mixed (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="per system and mix (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--dtype",
        choices=list(NEAR_TIE_TOLERANCES),
        default=None,
        help="weights and KV pages (default float32 on cpu, bfloat16 on cuda)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts (default 0)")
    parser.add_argument("--json-out", type=output_path, help="write the figures as JSON here")
    return parser


def parse_args() -> argparse.Namespace:
    """The command line, checked; SystemExit naming what is wrong."""
    parser = build_parser()
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs CUDA, which this machine lacks")
    args.geometry = args.geometry or ("llama-1b" if args.device == "cuda" else "256x4,512x8")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    try:
        args.geometries = {
            name: hf_geometry(name, args.vocab_size) for name in split(args.geometry)
        }
        args.prompt_range = int_range(args.prompt_tokens)
        args.mixed_range = int_range(args.mixed_new_tokens)
    except ValueError as error:
        parser.error(str(error))
    unknown = set(split(args.mixes)) - {"static", "mixed"}
    if unknown or min(args.repeats, args.threads, args.max_num_seqs) < 1:
        parser.error("--mixes takes static,mixed; --repeats, --threads, --max-num-seqs >= 1")
    return args


def split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def int_range(text: str) -> tuple[int, int]:
    """``MIN,MAX`` as two ints with 1 <= MIN <= MAX; ValueError otherwise. Pure."""
    low, high = (int(part) for part in text.split(","))
    if not 1 <= low <= high:
        raise ValueError(f"range {text!r} needs 1 <= MIN <= MAX")
    return low, high


def hf_geometry(name: str, vocab_size: int) -> dict:
    """HF LlamaConfig keys for a named geometry or ``HxL``; ValueError for neither. Pure."""
    if name in NAMED_GEOMETRIES:
        return NAMED_GEOMETRIES[name]
    hidden, _, layers = name.partition("x")
    if not (hidden.isdigit() and layers.isdigit() and int(hidden) % 64 == 0 and int(layers)):
        raise ValueError(f"geometry {name!r}: expected HxL with H a multiple of 64, or llama-1b")
    num_heads = int(hidden) // 64
    return dict(
        hidden_size=int(hidden),
        intermediate_size=64 * math.ceil(8 * int(hidden) / 3 / 64),
        num_hidden_layers=int(layers),
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=64,
        vocab_size=vocab_size,
    )


def save_checkpoint(path: str, geometry: dict, seed: int, dtype: torch.dtype):
    """An HF Llama with seeded weights (order-1 logits: clear greedy argmaxes), saved to ``path``;
    returns the HF model."""
    config = transformers.LlamaConfig(
        **geometry, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None
    )
    model = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                scale = 1.0 if "embed_tokens" in name else 1 / math.sqrt(param.shape[1])
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model = model.to(dtype)
    model.save_pretrained(path)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # every request runs to its length
    return model


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


def hf_generate(model, mix: Mix, device: str) -> list[list[int]]:
    """HF greedy tokens of every request: static batches of ``max_num_seqs`` in order, left-padded,
    each until its longest request ends, cut to what each request asked for."""
    outputs = []
    for start in range(0, len(mix.prompts), mix.max_num_seqs):
        prompts = mix.prompts[start : start + mix.max_num_seqs]
        new_tokens = mix.new_tokens[start : start + mix.max_num_seqs]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.inference_mode():
            generated = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max(new_tokens),
                do_sample=False,
            )
        for row, num_new in zip(generated[:, width:].tolist(), new_tokens):
            outputs.append(row[:num_new])
    return outputs


def workload(mix: Mix, dtype: str, schedule_policy: str) -> Workload:
    """The mix as a batchgen workload, all at step 0, with ``dtype`` pools that hold every request.
    Pure."""
    requests = [
        WorkloadRequest(uuid=f"r{i}", prompt_ids=prompt, max_new_tokens=num_new)
        for i, (prompt, num_new) in enumerate(zip(mix.prompts, mix.new_tokens))
    ]
    num_pages = sum(-(-(len(p) + n) // PAGE_SIZE) for p, n in zip(mix.prompts, mix.new_tokens))
    return Workload(
        name=mix.name,
        cache=CacheConfig(
            page_size=PAGE_SIZE,
            num_gpu_pages=num_pages + 1,
            num_host_pages=0,
            dtype=dtype,
            watermark=0.0,
        ),
        engine=EngineConfig(
            max_num_seqs=mix.max_num_seqs,
            max_num_batched_tokens=sum(map(len, mix.prompts)) + len(mix.prompts),
            schedule_policy=schedule_policy,
        ),
        requests=requests,
    )


def new_worker(
    model, mix: Mix, device: str, schedule_policy: str = "fcfs"
) -> tuple[Worker, Workload]:
    """A worker for ``mix`` whose KV pages have the model's dtype, and the workload."""
    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    job = workload(mix, dtype, schedule_policy)
    worker = Worker(
        model,
        cache_config=job.cache,
        engine_config=job.engine,
        kv_gate=KvGateConfig(),
        device=device,
    )
    return worker, job


@dataclass(frozen=True, slots=True)
class Timed:
    outputs: list[list[int]]
    wall_s: float
    cpu_s: float


def timed(generate, device: str) -> Timed:
    """Run ``generate()`` (-> tokens per request), with its wall and process CPU seconds."""
    if device == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = generate()
    if device == "cuda":
        torch.cuda.synchronize()
    return Timed(outputs, time.perf_counter() - wall, time.process_time() - cpu)


def run_batchgen(model, mix: Mix, device: str, schedule_policy: str) -> Timed:
    """batchgen's output of every request (request order) from a fresh worker, timed without the
    worker's construction (its pools)."""
    worker, job = new_worker(model, mix, device, schedule_policy)

    def generate() -> list[RequestOutput]:
        result = run_workload(worker, job)
        return [result.outputs[f"r{i}"] for i in range(len(mix.prompts))]

    return timed(generate, device)


def measure(hf_model, model, mix: Mix, args: argparse.Namespace) -> list[dict]:
    """HF and batchgen under each of the mix's schedule policies, interleaved ``--repeats`` times
    after one warm-up each; one row per policy, HF's timings in each."""
    runs = {"hf": lambda: timed(lambda: hf_generate(hf_model, mix, args.device), args.device)}
    for policy in mix.schedule_policies:
        runs[policy] = lambda policy=policy: run_batchgen(model, mix, args.device, policy)
    outputs = {name: run().outputs for name, run in runs.items()}  # warm-up
    samples = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name in sorted(runs, reverse=repeat % 2 == 1):
            samples[name].append(runs[name]())
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


def near_tie(hf_tokens: list[int], ours: RequestOutput, tolerance: float) -> bool | None:
    """None when batchgen's tokens equal HF's; else whether the first differing token is a near-tie:
    both tokens are batchgen's top two there, their log-probabilities within ``tolerance``. Pure."""
    ours_tokens = list(ours.output_ids)
    if ours_tokens == hf_tokens:
        return None
    position = next((i for i, (a, b) in enumerate(zip(hf_tokens, ours_tokens)) if a != b), None)
    if position is None:  # one is a prefix of the other
        return False
    logprobs = dict(
        zip(ours.output_logprobs[position].top_ids, ours.output_logprobs[position].top_logprobs)
    )
    tokens = (hf_tokens[position], ours_tokens[position])
    return (
        all(t in logprobs for t in tokens)
        and abs(logprobs[tokens[0]] - logprobs[tokens[1]]) < tolerance
    )


def decode_steps(model, mix: Mix, device: str) -> dict:
    """Median decode-only step time of ``mix`` against the bound of reading every weight and the KV
    once per step at the measured device copy bandwidth."""
    worker, job = new_worker(model, mix, device)
    for request in job.requests:
        worker.add_request(request.to_request())
    kv_bytes_per_token = model.config.num_layers * 2 * model.config.num_kv_heads
    kv_bytes_per_token *= model.config.head_dim * worker.gpu_kv.tensor.element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:  # a lookup reads a row per token, not the table
        embedding = model.model.embed_tokens.weight
        weight_bytes -= embedding.numel() * embedding.element_size()
    bandwidth = copy_bandwidth(device)
    step_s, bound_s = [], []
    while worker.has_unfinished():
        running = [r for r in worker.state.requests.values() if r.num_cached_tokens]
        before = worker.state.stats.tokens_generated
        torch.cuda.synchronize()
        started = time.perf_counter()
        worker.step()
        torch.cuda.synchronize()
        # decode-only steps: every request had its prompt cached and got one token
        if running and worker.state.stats.tokens_generated - before == len(running):
            step_s.append(time.perf_counter() - started)
            num_cached = sum(r.num_cached_tokens for r in running)
            bound_s.append((weight_bytes + num_cached * kv_bytes_per_token) / bandwidth)
    return {
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes": weight_bytes,
        "decode_step_ms": 1e3 * statistics.median(step_s),
        "bound_step_ms": 1e3 * statistics.median(bound_s),
        "bound_over_step": statistics.median(b / s for b, s in zip(bound_s, step_s)),
    }


def copy_bandwidth(device: str, num_bytes: int = 2**30) -> float:
    """Bytes/s moved (read + written) by the best of five device-to-device copies."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * num_bytes / best


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


def main() -> None:
    args = parse_args()
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
            decode[name] = decode_steps(model, static, args.device)
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


if __name__ == "__main__":
    main()
