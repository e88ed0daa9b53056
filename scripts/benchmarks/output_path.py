"""``output_path``: the argparse type of the benchmarks' ``--json-out`` files, and
``write_output``.

A benchmark writes its figures after a run of minutes; a path it cannot write is
refused when the arguments are parsed (one ``error:`` line, exit 2), not by a
traceback at the end; a write that still fails then (a full disk) is one
``error:`` line and exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def output_path(text: str) -> Path:
    """``text`` as a ``Path`` to a file that can be created or replaced; ``ArgumentTypeError``
    otherwise. Pure."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("needs a file path, got an empty one")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file to write")
    directory = path.parent
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: no directory {directory}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: directory {directory} is not writable"
        )
    # what a write creates (a dangling symlink's target), not the link
    target = Path(os.path.realpath(path))
    existed = target.exists()
    # os.access says yes to root everywhere, /proc included: try it (a file made for the test is
    # removed)
    try:
        with open(target, "a"):
            pass
        if not existed:
            target.unlink()
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: {error.strerror or error}"
        ) from None
    return path


def write_output(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (UTF-8); a write that fails ends the benchmark with one ``error:``
    line and exit 1 (what it measured is in the tables printed above)."""
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        print(
            f"{Path(sys.argv[0]).name}: error: cannot write {path}: {error.strerror or error} (the"
            " figures are in the tables above)",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
