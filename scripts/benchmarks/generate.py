"""``batchgen generate`` against ``batchgen run`` on the same requests, and the text edge's share.

One process, one seeded HF Llama checkpoint (``--geometry``, default 512x8: hidden 512, 8 layers)
with make-checkpoint's trained tokenizer beside it. ``--num-lines`` completion lines (prompts of
8-24 corpus words, 8-24 new tokens, greedy, ``ignore_eos``, a stop string that never appears, so
every sample is decoded incrementally and checked) run twice on fresh workers of the same pools:

    generate  the batch file through BatchJob: parsing, tokenization, engine, detokenization, stop
              checks, result lines written to a file
    run       the same prompts as token ids (tokenized beforehand), one workload through
              run_workload, as ``batchgen run`` drives it

CPU seconds are the process's (``time.process_time``, on ``--threads`` torch threads); the text
edge's own CPU time (reading lines, tokenizing, detokenizing, stop checks, shaping results) is
measured as it runs (``time.thread_time`` around each piece: ``TextEngine.text_cpu``), not as a
difference of two runs. Goal: text at most 5% of generate's CPU seconds. Tokens are compared too:
generate admits lines as others finish and run admits all at once, so batches differ and a float
near-tie may flip a token (counted, not failed).

    python scripts/bench.py generate [--num-lines 2000] [--geometry 512x8] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest
from batchgen.model.loader import load_model
from batchgen.openai.batch_job import BatchJob, numbered_lines
from batchgen.text.generation import TextEngine
from batchgen.text.tiny_checkpoint import CORPUS, write_tokenizer_files
from batchgen.text.tokenizer import TextTokenizer
from compare.jsonl_writer import JsonLinesFile

from .ab_timer import timed_run
from .hf_checkpoint import hf_geometry, save_checkpoint

VOCAB_SIZE, MAX_CONTEXT = 512, 4096
GOAL = 0.05
STOP = "The end of the story."


def build_lines(num_lines: int, seed: int) -> list[dict]:
    """Seeded completion lines (see the module docstring). Pure."""
    rng = random.Random(seed)
    words = " ".join(CORPUS).split()
    return [
        {
            "custom_id": f"b{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "prompt": " ".join(rng.choices(words, k=rng.randint(8, 24))),
                "max_tokens": rng.randint(8, 24),
                "temperature": 0.0,
                "ignore_eos": True,
                "stop": [STOP],
            },
        }
        for i in range(num_lines)
    ]


def run_generate(model, tokenizer, cache, engine_config, in_path: Path, out_path: Path) -> dict:
    """The job through BatchJob on a fresh worker; its times and tokens (by custom_id)."""
    worker = Worker(model, cache_config=cache, engine_config=engine_config)
    engine = TextEngine(worker, tokenizer)
    out = JsonLinesFile(out_path)
    out.open()
    out.truncate()
    job = BatchJob(engine, out, served_model="bench", seed=0, max_in_flight=256)
    timed = timed_run(lambda: job.run(numbered_lines(in_path)))
    out.close()
    texts = {}
    for line in out_path.read_text().splitlines():
        data = json.loads(line)
        texts[data["custom_id"]] = data["response"]["body"]["choices"][0]["text"]
    return {
        "wall_s": timed.wall_s,
        "cpu_s": timed.cpu_s,
        "text_cpu_s": engine.text_cpu.seconds,
        "tokens": job.counts.tokens_generated,
        "texts": texts,
    }


def run_ids(model, tokenizer, cache, engine_config, lines: list[dict]) -> dict:
    """The same requests as token ids through run_workload on a fresh worker."""
    requests = [
        WorkloadRequest(
            uuid=line["custom_id"],
            prompt_ids=tokenizer.encode(line["body"]["prompt"]),
            max_new_tokens=line["body"]["max_tokens"],
        )
        for line in lines
    ]
    workload = Workload(name="bench", cache=cache, engine=engine_config, requests=requests)
    worker = Worker(model, cache_config=cache, engine_config=engine_config)
    timed = timed_run(lambda: run_workload(worker, workload))
    result = timed.result
    texts = {u: tokenizer.decode(o.output_ids) for u, o in result.outputs.items()}
    return {
        "wall_s": timed.wall_s,
        "cpu_s": timed.cpu_s,
        "tokens": result.tokens_generated,
        "texts": texts,
    }


def main(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-lines", type=int, default=2000)
    parser.add_argument("--geometry", default="512x8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        save_checkpoint(tmp, hf_geometry(args.geometry, VOCAB_SIZE), args.seed, torch.float32)
        write_tokenizer_files(directory, VOCAB_SIZE, MAX_CONTEXT)
        lines = build_lines(args.num_lines, args.seed)
        in_path = directory / "in.jsonl"
        in_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        tokenizer, model = TextTokenizer(tmp), load_model(tmp)
        cache = CacheConfig(page_size=16, num_gpu_pages=1024, num_host_pages=64)
        engine_config = EngineConfig(max_num_seqs=64)
        run_ids(model, tokenizer, cache, engine_config, lines[:32])  # warm up
        ran = run_ids(model, tokenizer, cache, engine_config, lines)
        generated = run_generate(model, tokenizer, cache, engine_config, in_path, directory / "o")
    return 0 if print_table(args, ran, generated) else 1


def print_table(args: argparse.Namespace, ran: dict, generated: dict) -> bool:
    """The two runs side by side, and the ratios; returns whether the text share met the goal."""
    share = generated["text_cpu_s"] / generated["cpu_s"]
    differ = sum(generated["texts"][k] != text for k, text in ran["texts"].items())
    title = f"generate vs run: {args.num_lines} lines, {args.geometry}, {args.threads} thread(s)"
    table = Table(title=title)
    for column in ("", "wall s", "CPU s", "tokens", "text CPU s", "text share"):
        table.add_column(column, justify="right")
    table.add_row(
        "run (token ids)",
        f"{ran['wall_s']:.1f}",
        f"{ran['cpu_s']:.1f}",
        str(ran["tokens"]),
        "-",
        "-",
    )
    table.add_row(
        "generate",
        f"{generated['wall_s']:.1f}",
        f"{generated['cpu_s']:.1f}",
        str(generated["tokens"]),
        f"{generated['text_cpu_s']:.2f}",
        f"{share:.1%}",
    )
    console = Console()
    console.print(table)
    console.print(
        f"generate / run CPU: {generated['cpu_s'] / ran['cpu_s']:.2f}x; lines whose text differs"
        f" from run's (batch composition, near-ties): {differ}; goal text share <= {GOAL:.0%}:"
        f" {'met' if share <= GOAL else 'MISSED'}"
    )
    return share <= GOAL
