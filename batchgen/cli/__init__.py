"""The ``batchgen`` command: flags -> library call -> rendering, nothing more.

::

    run       one workload on a fresh worker         --workload NAME|FILE [KV flags] [--faults SPEC]
    validate  back-to-back, compare mode             [--scale X] [--reports-dir DIR]
    report    divergence logs -> report              LOG [LOG...] [--format FORMAT] [--out FILE]
    replay    re-run one logged op                   LOG --index N
    minimize  shrink it, write a regression test     LOG --index N [--out-dir DIR] [--max-tests N]
    explore   search for workloads reaching every KV decision, write a corpus   [--max-runs N]
    sweep     compare mode over a matrix, on Ray     [--workload W] [--seeds A-B] [--faults SPEC]
    generate  an OpenAI batch file -> its results    -i IN.jsonl -o OUT.jsonl --model DIR [--resume]
    make-checkpoint  the tiny model + a trained tokenizer as an HF directory    DIR [--seed N]
    real-model  fetch SmolLM2-135M-Instruct (GGUF) into the cache, print its path   [--hf-dir]

A subcommand is a module of its name with an ``add_<name>_command`` (declares its flags, shares
``common``'s, ``arg_types``' value parsers and ``backend_args``) and a handler
``args -> exit code``.
Exit codes: 0 done (report: no divergence; replay: reproduced), 1 failed
(validation failed, divergences found, not reproduced, stdout closed early or unwritable, a full
disk), 2 bad input (one ``batchgen: error:`` line on stderr naming what was wrong and what is
allowed; stdout closed from the start and a path the system refuses are too), 130 Ctrl-C, 143
SIGTERM (both after the same cleanup). No OSError ends a command with a traceback.
Progress and warnings go to stderr, results to stdout; ``--json`` prints
exactly one JSON object.
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import os
import sys
from collections.abc import Iterator, Sequence

import torch

from batchgen.cli.common import UsageError
from batchgen.cli.explore import add_explore_command
from batchgen.cli.generate import add_generate_command
from batchgen.cli.make_checkpoint import add_make_checkpoint_command
from batchgen.cli.minimize import add_minimize_command
from batchgen.cli.real_model import add_real_model_command
from batchgen.cli.replay import add_replay_command
from batchgen.cli.report import RENDERERS, add_report_command
from batchgen.cli.run import add_run_command
from batchgen.cli.sweep import add_sweep_command
from batchgen.cli.validate import add_validate_command
from batchgen.engine.faults import FaultSpecError
from batchgen.engine.host_malloc import keep_freed_memory
from batchgen.engine.request_checks import RequestError
from batchgen.engine.workloads import WorkloadError
from batchgen.exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    Terminated,
)
from batchgen.kv.gate import GateError
from batchgen.kv.tiers import PoolAllocationError
from batchgen.metrics.config import MetricsConfigError
from batchgen.model.loader import ModelLoadError
from batchgen.sweep.backends import BackendError
from batchgen.sweep.matrix import SweepError
from batchgen.text.generation_defaults import GenerationConfigError
from batchgen.text.tokenizer import TokenizerError
from batchgen.triage.minimize import MinimizeError
from batchgen.triage.rebuild import ReplayError
from compare import RecordError

__all__ = ["RENDERERS", "build_parser", "main"]

INPUT_ERRORS = (
    UsageError,
    WorkloadError,
    ModelLoadError,
    RequestError,
    PoolAllocationError,
    GateError,
    # MinimizeError: a record minimize cannot use
    FaultSpecError,
    RecordError,
    ReplayError,
    MinimizeError,
    SweepError,
    BackendError,
    MetricsConfigError,
    TokenizerError,
    GenerationConfigError,
)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are the same one ``batchgen: error:`` line as every bad input."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"batchgen: error: {message} (see '{self.prog} --help')\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's), run the subcommand, return its exit code. Sets
    the process's malloc to keep freed memory (``host_malloc``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # --help (0), or a usage error already printed (2)
        return int(exit_request.code or 0)
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        return _refuse_closed_stdout()
    stdout, sys.stdout = sys.stdout, _CheckedStdout(sys.stdout)
    keep_freed_memory()  # a forward's activations reuse freed memory, no page faults a step
    try:
        code = args.handler(args)
        # a write that fails (a full disk behind a redirect) fails here, not after exit
        sys.stdout.flush()
        return code
    except INPUT_ERRORS as error:
        print(f"batchgen: error: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Terminated:  # SIGTERM, under the entry point: the same cleanup as Ctrl-C
        print("batchgen: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    # what was written is complete: logs end in whole records, reports are atomic
    except KeyboardInterrupt:
        print("batchgen: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    # stdout's reader went away (`| head`); files written are whole, as above
    except BrokenPipeError:
        _discard_stdout()
        print("batchgen: stdout was closed before all output was written", file=sys.stderr)
        return EXIT_FAILED
    except StdoutWriteError as error:
        _discard_stdout()
        print(
            f"batchgen: cannot write to stdout: {error.strerror or error}; files written are whole",
            file=sys.stderr,
        )
        return EXIT_FAILED
    # a path the system refuses (too long, not permitted, ...), or a full disk
    except OSError as error:
        given = sys.argv[1:] if argv is None else argv
        print(f"batchgen: error: {os_error_line(error, given)}", file=sys.stderr)
        return EXIT_BAD_INPUT if refuses_a_given_path(error, given) else EXIT_FAILED
    finally:
        sys.stdout = stdout


def _refuse_closed_stdout() -> int:
    """The error for a process started with stdout closed: its results would vanish and its exit
    say 0."""
    print(
        "batchgen: error: stdout is closed; batchgen writes its results there (redirect it, to"
        " /dev/null if they are not wanted)",
        file=sys.stderr,
    )
    return EXIT_BAD_INPUT


# Errors that say a path cannot be used as it is named: bad input when the path is one the command
# line gave. Any other OSError (a full disk, an I/O error, an EINVAL from inside a library, a path
# of batchgen's own) is a failure of the run.
PATH_ERRNOS = frozenset(
    {
        errno.ENAMETOOLONG,
        errno.EACCES,
        errno.EPERM,
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ELOOP,
        errno.EROFS,
        errno.EEXIST,
        errno.EINVAL,
    }
)
_SHOWN_PATH_CHARS = 60


def refuses_a_given_path(error: OSError, argv: Sequence[str]) -> bool:
    """Whether ``error`` is the system refusing a path ``argv`` gave (an argument, or an option's
    value). Pure."""
    given = {*argv, *(value for _, value in _option_values(argv))}
    names = (error.filename, error.filename2)
    return error.errno in PATH_ERRNOS and any(
        name is not None and str(name) in given for name in names
    )


def os_error_line(error: OSError, argv: Sequence[str]) -> str:
    """One line for ``error``: the option of ``argv`` that gave the path (when one did), what the
    system said, the path(s) it named (a long one cut short), and the limit a too-long name broke.
    Pure."""
    names = [name for name in (error.filename, error.filename2) if name is not None]
    line = error.strerror or str(error)
    if names:
        line = f"{line}: {' -> '.join(map(_shown_path, names))}"
    flag = next((flag for flag, value in _option_values(argv) if value in map(str, names)), None)
    if flag is not None:
        line = f"{flag}: {line}"
    if error.errno == errno.ENAMETOOLONG:
        line += f"; a file or directory name holds at most {_name_max()} bytes"
    return line


def _option_values(argv: Sequence[str]) -> Iterator[tuple[str, str]]:
    """(option, value) for each ``--option value`` and ``--option=value`` of ``argv``."""
    for i, token in enumerate(argv):
        if token.startswith("--") and "=" in token:
            yield tuple(token.split("=", 1))
        elif token.startswith("--") and i + 1 < len(argv):
            yield token, argv[i + 1]


def _name_max() -> int:
    try:
        return os.pathconf(".", "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _shown_path(name) -> str:
    text = os.fsdecode(name) if isinstance(name, (str, bytes)) else str(name)
    if len(text) <= _SHOWN_PATH_CHARS:
        return repr(text)
    return f"{text[:_SHOWN_PATH_CHARS]!r}... ({len(text)} characters)"


def _version() -> str:
    """The installed batchgen's version, and torch's (the project runs on a range of them)."""
    try:
        version = importlib.metadata.version("batchgen")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        version = "(not installed)"
    return f"{version} (torch {torch.__version__})"


class StdoutWriteError(OSError):
    """A write to stdout failed with something other than a closed pipe (a full disk behind a
    redirect)."""


class _CheckedStdout:
    """``stream`` (stdout), whose failed writes raise :class:`StdoutWriteError`: an OSError from
    anywhere else stays what it is. A closed pipe stays BrokenPipeError."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        return _checked(self._stream.write, text)

    def flush(self) -> None:
        _checked(self._stream.flush)


def _checked(call, *args):
    """``call(*args)``, its OSError (a closed pipe aside) raised as StdoutWriteError."""
    try:
        return call(*args)
    except BrokenPipeError:
        raise
    except OSError as error:
        raise StdoutWriteError(error.errno, error.strerror) from error


def _discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null: what is still buffered goes nowhere, and the flush at
    exit cannot fail again. Mutates the process's descriptor 1."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="batchgen",
        description="Batch-generation LLM worker with a paged two-tier (GPU + host) KV cache.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {_version()}",
        help="print batchgen's version and torch's, and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_command(commands)
    add_validate_command(commands)
    add_report_command(commands)
    add_replay_command(commands)
    add_minimize_command(commands)
    add_explore_command(commands)
    add_sweep_command(commands)
    add_generate_command(commands)
    add_make_checkpoint_command(commands)
    add_real_model_command(commands)
    return parser
