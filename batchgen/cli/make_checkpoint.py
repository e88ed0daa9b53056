"""``batchgen make-checkpoint DIR``: the seeded tiny model as an HF checkpoint directory with a
trained BPE tokenizer and a chat template (``batchgen.text.tiny_checkpoint``)."""

from __future__ import annotations

import argparse

from batchgen.cli.arg_types import seed_int
from batchgen.cli.common import check_directory
from batchgen.exit_codes import EXIT_OK
from batchgen.text.tiny_checkpoint import make_checkpoint


def add_make_checkpoint_command(commands) -> None:
    parser = commands.add_parser(
        "make-checkpoint",
        help="write the tiny model, a trained tokenizer and a chat template as an HF directory",
        description=(
            "Write the seeded tiny model (TINY_MODELS['tiny']) as an HF checkpoint directory:"
            " config.json, model.safetensors, generation_config.json, and a byte-level BPE of 512"
            " tokens trained on a few sentences (tokenizer.json, tokenizer_config.json with a chat"
            " template). Files of those names in DIR are replaced."
        ),
    )
    parser.add_argument("directory", metavar="DIR", help="the directory to write (created)")
    parser.add_argument(
        "--seed", type=seed_int, default=0, help="seeds the weights (default: %(default)s)"
    )
    parser.set_defaults(handler=_make_checkpoint)


def _make_checkpoint(args: argparse.Namespace) -> int:
    check_directory("DIR", args.directory)
    path = make_checkpoint(args.directory, seed=args.seed)
    print(f"wrote the tiny checkpoint (seed {args.seed}) to {path}")
    return EXIT_OK
