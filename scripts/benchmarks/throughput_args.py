"""The command line of ``bench.py throughput``: its flags, their defaults per device, and the
checks that refuse a bad value before anything is measured.
"""

from __future__ import annotations

import argparse

import torch

from batchgen.validation.output_check import NEAR_TIE_TOLERANCES

from .hf_checkpoint import hf_geometry
from .output_path import output_path


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
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


def parse_args(argv: list[str], prog: str, description: str) -> argparse.Namespace:
    """The command line, checked; SystemExit naming what is wrong."""
    parser = build_parser(prog, description)
    args = parser.parse_args(argv)
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
