"""``output_path``: the argparse type of the scripts' ``--json-out`` / ``--md-out`` files.

A benchmark writes its figures after a run of minutes; a path it cannot write is
refused when the arguments are parsed (one ``error:`` line, exit 2), not by a
traceback at the end.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def output_path(text: str) -> Path:
    """``text`` as a ``Path`` to a file that can be created or replaced; ``ArgumentTypeError`` otherwise. Pure."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("needs a file path, got an empty one")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file to write")
    directory = path.parent
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: no directory {directory}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: directory {directory} is not writable")
    return path
