"""``batchgen run --outputs FILE``: what each request produced, one JSON line per request, written
as it is released.

One line per released request, in release order, keys in this order::

    {"uuid": "smoke-r0", "phase": "finished", "finish_reason": "length",
     "output_ids": [413, 431, 16]}

    uuid           the request's uuid
    phase          "finished" or "failed"
    finish_reason  "length", "eos" or "abort" (phase finished); the failure, e.g.
                   "load failed: ..." (phase failed)
    output_ids     the generated token ids, prompt excluded (those generated before a failure
                   or an abort too)

Log-probabilities are left out: the worker keeps only the top two per position, for the
near-tie output check, which compares runs in-process.

The file is replaced: created, or truncated, when the run starts. Each line is handed to
the OS (``compare.jsonl_writer``, the one durable writer of JSON lines) before the next step runs,
so a run that stops early (a stall, Ctrl-C, SIGTERM, SIGKILL) leaves a whole line for
every request released so far; a write that fails part way (a full disk) is cut off
before its error propagates.
"""

from __future__ import annotations

import json
import os
from contextlib import suppress
from pathlib import Path
from types import TracebackType

from batchgen.cli.common import UsageError, check_output_file, missing_directories, remove_empty
from batchgen.state import RequestOutput
from compare.jsonl_writer import JsonLinesFile


class OutputsWriteError(OSError):
    """A line, or the flush at close, did not reach the outputs file (a full disk, say); the file
    still ends in whole lines. ``str()`` names the file and the OS's reason."""

    def __init__(self, path: Path, error: OSError):
        super().__init__(error.errno, f"{path}: a write failed: {error.strerror or error}")

    def __str__(self) -> str:
        return self.strerror


_STANDARD_STREAMS = (
    (1, "standard output, where results go"),
    (2, "standard error, where progress and warnings go"),
)


def check_outputs_path(path: str, others: dict[str, str]) -> None:
    """UsageError when ``path`` (``--outputs``) cannot be written: empty, a directory, under a file,
    in a directory that is not writable, a file that is not writable, the same file as one of
    ``others`` (what it is -> its path: the workload file, the divergence log), which truncating it
    would destroy, or the file standard output or standard error go to (``/dev/stdout``), which the
    summary or the progress bar would write over. Pure."""
    check_output_file("--outputs", path, "the outputs")
    target = Path(path).resolve()
    for what, other in others.items():
        if Path(other).resolve() == target:
            raise UsageError(
                f"--outputs {path}: it is {what} ({other}); name another file for the outputs"
            )
    _check_not_a_standard_stream(path)
    nearest = next(p for p in (Path(path).absolute(), *Path(path).absolute().parents) if p.exists())
    if not os.access(nearest, os.W_OK | (os.X_OK if nearest.is_dir() else 0)):
        raise UsageError(f"--outputs {path}: cannot write the outputs: {nearest} is not writable")


def _check_not_a_standard_stream(path: str) -> None:
    """UsageError when ``path`` is the file behind standard output or standard error (/dev/null
    aside). Pure."""
    try:
        target = os.stat(path)
    except OSError:
        return  # not there yet: no stream goes to it
    if os.path.exists(os.devnull) and os.path.samefile(path, os.devnull):
        return
    for fd, what in _STANDARD_STREAMS:
        try:
            stream = os.fstat(fd)
        except OSError:
            continue
        if (stream.st_dev, stream.st_ino) == (target.st_dev, target.st_ino):
            raise UsageError(f"--outputs {path}: it is {what}; name a file for the outputs")


def output_line(output: RequestOutput) -> str:
    """``output`` as one line of the outputs file, without its newline. Pure."""
    return json.dumps(
        {
            "uuid": output.uuid,
            "phase": output.phase.value,
            "finish_reason": output.finish_reason,
            "output_ids": list(output.output_ids),
        }
    )


class OutputsFile:
    """The outputs file: opened (created or truncated) by :meth:`open`, one line per :meth:`write`,
    through the one durable writer of JSON lines (``compare.jsonl_writer``).

    Mutates the file and its own descriptor. One writer per file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = JsonLinesFile(self.path)
        self._made: list[Path] = []  # the parent directories open created
        self._created = False  # whether open created the file

    def open(self) -> None:
        """Open the file, creating it and its parent directories, as it is: :meth:`start` truncates
        it, so that a run that fails to start (its divergence log unwritable) leaves an earlier file
        whole (:meth:`discard`). OSError, with the directories it made removed again, when it cannot
        be opened."""
        self._made = missing_directories(self.path.parent)
        self._created = not os.path.lexists(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file.open()
        except OSError:
            remove_empty(self._made)
            raise

    def start(self) -> None:
        """Truncate a regular file: the run starts writing. Mutates the file."""
        self._file.truncate()

    def discard(self) -> None:
        """Close the file unwritten, and remove what :meth:`open` created: the file and its new
        directories."""
        with suppress(OSError):
            self._file.close()
        if self._created:
            with suppress(OSError):
                self.path.unlink()
        remove_empty(self._made)

    def write(self, output: RequestOutput) -> None:
        """Write ``output``'s line. A write that fails part way is cut off again (on a regular file)
        before the error propagates (OutputsWriteError), so the file ends in whole lines."""
        try:
            self._file.write_line(output_line(output))
        except OSError as error:
            raise OutputsWriteError(self.path, error) from error

    def close(self) -> None:
        """Flush a regular file to disk and close it (OutputsWriteError when the flush fails)."""
        try:
            self._file.close()
        except OSError as error:
            raise OutputsWriteError(self.path, error) from error

    def __enter__(self) -> OutputsFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close the file; when the block raised, its error is the one reported, not a failed
        flush."""
        if error is None:
            self.close()
            return
        try:
            self.close()
        except OutputsWriteError:
            pass
