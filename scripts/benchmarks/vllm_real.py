"""The real model in ``bench.py vllm --model real``: SmolLM2-135M-Instruct (30 layers, hidden 576,
9 query heads and 3 KV heads of 64, vocabulary 49152, tied embeddings) from its HF directory
(``reference_directory``: transformers' float32 save of the project's GGUF file), the same
directory for both engines.

The mix: 64 seeded requests of 16-256 prompt tokens drawn from the tokenizer's ordinary tokens
(ids 17 on; 0-16 are its special tokens), 128 new tokens each, greedy, ``ignore_eos``; a step's
budget admits every prompt at once in both engines. A cell is a thread count, a dtype and the
sequences run at a time (``CELLS``); each is measured as ``vllm_measure.measure`` measures a mix,
then one more batchgen run says where a steady decode step's time goes against its matmuls
(``decode_bound.step_breakdown``).
"""

from __future__ import annotations

import math
import random
import tempfile
from dataclasses import dataclass

from rich.table import Table

from batchgen.config import DTYPE_SIZES, ModelConfig, pages_needed
from batchgen.model.loader import load_model
from batchgen.validation.hf_reference import reference_directory

from .decode_bound import step_breakdown
from .throughput import Mix, batched_tokens, new_worker
from .throughput_args import split
from .vllm_job import VllmRunner
from .vllm_measure import bound_to, ignoring_eos, measure

NUM_REQUESTS, PROMPT_TOKENS, NEW_TOKENS = 64, (16, 256), 128
FIRST_ORDINARY_ID = 17  # SmolLM2's ids 0-16 are special tokens (<|endoftext|>, <|im_start|>, ...)
MODEL_NAME = "SmolLM2-135M"


@dataclass(frozen=True, slots=True)
class Cell:
    threads: int
    dtype: str
    max_num_seqs: int


CELLS = {
    "1t-fp32-16": Cell(1, "float32", 16),
    "1t-fp32-64": Cell(1, "float32", 64),
    "1t-bf16-64": Cell(1, "bfloat16", 64),
    "2t-fp32-64": Cell(2, "float32", 64),
}
TTFT = "ttft"  # the time-to-first-token measurement (``vllm_ttft``), run as a cell of its own


def parse_cells(text: str, num_cpus: int) -> list[str]:
    """The cells named in ``text`` (a comma list of ``CELLS`` and ``ttft``), each once, in order;
    ValueError naming an unknown one or one needing more CPUs than ``num_cpus``. Pure."""
    names = list(dict.fromkeys(split(text)))
    known = [*CELLS, TTFT]
    if not names or any(name not in known for name in names):
        raise ValueError(f"--cells takes a comma list of {', '.join(known)}, got {text!r}")
    too_wide = [name for name in names if name in CELLS and CELLS[name].threads > num_cpus]
    if too_wide:
        raise ValueError(f"--cells {', '.join(too_wide)}: more threads than this machine's CPUs")
    return names


def real_mix(max_num_seqs: int, vocab_size: int, seed: int) -> Mix:
    """The seeded mix of the module docstring, ``max_num_seqs`` at a time. Pure."""
    rng = random.Random(seed)
    lengths = [rng.randint(*PROMPT_TOKENS) for _ in range(NUM_REQUESTS)]
    prompts = [[rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(n)] for n in lengths]
    new_tokens = [NEW_TOKENS] * NUM_REQUESTS
    return Mix(f"real-{max_num_seqs}", prompts, new_tokens, max_num_seqs, ("fcfs",))


def kv_cache_gib(mix: Mix, config: ModelConfig, dtype: str, page_size: int) -> int:
    """GiB of KV cache (vLLM's ``VLLM_CPU_KVCACHE_SPACE``) that hold every request of ``mix`` at
    once, one GiB to spare: no preemption, as batchgen's pools. Pure."""
    pages = sum(pages_needed(len(p) + n, page_size) for p, n in zip(mix.prompts, mix.new_tokens))
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * DTYPE_SIZES[dtype]
    return math.ceil(pages * page_size * per_token / 2**30) + 1


def run_cell(name: str, args, python, log) -> dict:
    """One cell: both engines on the real mix (``measure``), then the step breakdown; batchgen on
    the CPUs vLLM is bound to, vLLM stopped while batchgen runs."""
    cell, directory = CELLS[name], str(reference_directory())
    model = load_model(directory, dtype=cell.dtype)
    mix = real_mix(cell.max_num_seqs, model.config.vocab_size, args.seed)
    with tempfile.TemporaryDirectory() as workdir:
        runner = VllmRunner(
            python,
            directory,
            mix,
            cell.threads,
            args.page_size,
            log,
            workdir=workdir,
            dtype=cell.dtype,
            batched_tokens=batched_tokens(mix),
            kv_cache_gib=kv_cache_gib(mix, model.config, cell.dtype, args.page_size),
        )
        try:
            with bound_to(cell.threads):
                row = measure(model, runner, mix, args.pairs, args.page_size)
                with runner.paused():
                    worker, job = new_worker(model, mix, "cpu", page_size=args.page_size)
                    row["breakdown"] = step_breakdown(model, ignoring_eos(worker), job)
        finally:
            runner.close()
    row.update(cell=name, geometry=f"{MODEL_NAME} {cell.dtype}", threads=cell.threads)
    row.update(mix=f"real, {cell.max_num_seqs} at a time", dtype=cell.dtype)
    row["matmul_step_ms"] = row["breakdown"]["matmul_only_ms"]
    return row


def render_breakdown(rows: list[dict]) -> Table:
    """Where a steady decode step goes, one row per cell, against its matmuls alone. Pure."""
    table = Table(title="A steady decode step of batchgen (every row decoding), median over steps")
    columns = ("cell", "rows", "step ms", "layer matmuls", "lm_head", "decode attention")
    for column in (*columns, "the rest", "matmuls alone ms"):
        table.add_column(column, justify="left" if column == "cell" else "right")
    for row in rows:
        parts = row["breakdown"]
        shares = ("layer_matmuls", "lm_head", "decode_attention", "rest")
        table.add_row(
            row["cell"],
            str(parts["rows"]),
            f"{parts['step_ms']:.1f}",
            *(f"{100 * parts[f'{share}_share']:.1f}%" for share in shares),
            f"{parts['matmul_only_ms']:.1f}",
        )
    return table
