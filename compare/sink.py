"""Where records go: an append-only JSON Lines log, its reader, and atomic report writes.

Durability (``compare.jsonl_writer``, the one writer of JSON lines): `JsonlSink.write` hands each
complete line to the OS before returning, so a process killed at any point (SIGKILL included)
leaves every record written before it intact; at worst the last line is cut short, and `read_log`
skips such a torn last line with a warning. A write that fails part way (a full disk) is cut off
before its error propagates. (Surviving a power loss needs `close()`'s fsync.)
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from compare.jsonl_writer import JsonLinesFile, is_torn
from compare.records import DivergenceRecord, LogRecord, RecordError, RunSummary, parse_record


class LogWriteError(OSError):
    """A record, or the flush at close, did not reach the log (a full disk, say). The log still ends
    in whole records; ``str()`` names the file and the OS's reason."""

    def __init__(self, path: Path, error: OSError):
        super().__init__(error.errno, f"{path}: a write failed: {error.strerror or error}")

    def __str__(self) -> str:
        return self.strerror  # without OSError's "[Errno N]" prefix: the message names the reason


class JsonlSink:
    """Appends records to a JSON Lines file, one line per record (through the one durable writer,
    ``compare.jsonl_writer``).

    Mutates the file and its own descriptor. The file and its parent directories are created on the
    first write (or `open`). If the file ends in a line torn by an earlier crash, the first write
    cuts that partial line off (with a warning), so the log stays readable and the new record never
    fuses with it; a last line that is whole JSON but lacks its newline gets one (kept, even if it
    is no valid record: the reader then names it). One writer per file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = JsonLinesFile(self.path)

    @property
    def _fd(self) -> int | None:
        """The open descriptor, None while closed."""
        return self._file.fd

    def write(self, record: DivergenceRecord | RunSummary) -> None:
        """Append ``record`` as one line. A write that fails part way (a full disk) is cut off again
        before the error propagates (LogWriteError), so the next record never fuses with a partial
        line."""
        line = record.model_dump_json()
        self.open()
        try:
            self._file.write_line(line)
        except OSError as error:
            raise LogWriteError(self.path, error) from error

    def open(self) -> None:
        """Open the file now (the first write does otherwise), creating it and its parent
        directories: an unwritable path fails here, before any work. OSError when it cannot be
        opened; RecordError, the file untouched, when it is not empty and not a log (its first line
        is no record)."""
        if self._file.fd is None:
            self._open()
            try:
                _check_is_a_log(self._file.fd, self.path)
            except RecordError:
                self.close()
                raise
            tail = self._file.cut_torn_tail()
            if tail:
                warnings.warn(
                    f"{self.path}: last line was cut short (earlier crash?); "
                    f"dropping its {len(tail)} bytes before appending",
                    stacklevel=2,
                )

    def close(self) -> None:
        """Flush the file to disk and close it (LogWriteError when the flush fails); a later write
        reopens it."""
        try:
            self._file.close()
        except OSError as error:
            raise LogWriteError(self.path, error) from error

    def _open(self) -> None:
        """Create the parent directories and open the file for appending. OSError when refused."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file.open(readable=True)

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def check_log_file(path: str | Path) -> None:
    """RecordError when ``path`` holds something other than a divergence log, which `JsonlSink`
    would refuse to append to; nothing when it is a log, empty, or absent. Pure."""
    try:
        # non-blocking: a FIFO without a writer must not hang
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return  # absent or unreadable: opening it for appending says what is wrong
    try:
        _check_is_a_log(fd, Path(path))
    finally:
        os.close(fd)


def _check_is_a_log(fd: int, path: Path) -> None:
    """RecordError unless the file is empty or blank, or its first line that is not blank is a JSON
    object with a ``schema_version`` (a record, maybe of a newer version) or, alone and without its
    newline, the start of one cut short by a crash (``_end_last_line`` drops it). Appending to any
    other file (a workload, a report) would change it; what is not a regular file (``/dev/full``, a
    FIFO) is not read. Pure."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return
    # its own descriptor: closing it leaves the sink's open
    with os.fdopen(os.dup(fd), "rb") as file:
        file.seek(0)
        first = next((raw for raw in file if raw.strip()), b"")  # read_log skips blank lines too
    line, newline = first.strip(), first.endswith(b"\n")
    if not line:
        return  # empty, or blank lines only
    if not newline and line.startswith(b"{") and is_torn(line):
        return  # the start of a record's JSON object, cut short: _end_last_line drops it
    try:
        data = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        data = None
    if not (isinstance(data, dict) and "schema_version" in data):
        raise RecordError(
            f"{path}: not a divergence log (its first line is no record), so nothing is "
            "appended to it; name a new file or an existing log"
        )


@dataclass(frozen=True, slots=True)
class LogReadResult:
    """Records read back from one or more logs."""

    records: tuple[LogRecord, ...]
    num_read: int  # records parsed
    num_skipped: int  # torn last lines skipped
    warnings: tuple[str, ...]  # one per skipped line, naming file and line


def read_log(path: str | Path) -> LogReadResult:
    """Read every record of a log; mutates nothing.

    Blank lines are ignored. A last line without a trailing newline that is not whole JSON (a write
    cut short) is skipped with a warning; any other bad line (one of a newer schema version too)
    raises RecordError naming `file:line` and the reason. A missing or unreadable file raises
    RecordError too."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise RecordError(f"{path}: cannot read divergence log: {error.strerror}") from None
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records: list[LogRecord] = []
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            records.append(_parse(path, number, raw))
    if not tail.strip():
        return LogReadResult(tuple(records), len(records), 0, ())
    try:
        records.append(_parse(path, len(lines) + 1, tail))
    except RecordError as error:
        if not is_torn(tail):
            raise
        warning = f"{error}; skipped as a torn last line"
        return LogReadResult(tuple(records), len(records), 1, (warning,))
    return LogReadResult(tuple(records), len(records), 0, ())


def _parse(path: Path, number: int, raw: bytes) -> LogRecord:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RecordError(
            f"{path}:{number}: invalid UTF-8 at byte {error.start} of the line"
        ) from None
    try:
        return parse_record(text)
    except RecordError as error:
        raise RecordError(f"{path}:{number}: {error}") from None


def read_logs(paths: Iterable[str | Path]) -> LogReadResult:
    """Read several logs, in order, into one result."""
    results = [read_log(path) for path in paths]
    return LogReadResult(
        records=tuple(record for result in results for record in result.records),
        num_read=sum(result.num_read for result in results),
        num_skipped=sum(result.num_skipped for result in results),
        warnings=tuple(warning for result in results for warning in result.warnings),
    )


def write_atomic(path: str | Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) so readers see the old file or the new, never half.

    Writes a temp file in the same directory, flushes and fsyncs it, then `os.replace`s it; an
    existing file keeps its permission bits (a new one gets 0644). Creates parent directories.
    A symlink is followed: its target is replaced, the link stays. Something that is not a regular
    file (`/dev/null`, `/dev/stdout`, a FIFO) cannot be replaced and is written through instead.
    """
    try:
        mode = os.stat(path).st_mode  # through any symlink: /dev/stdout on a pipe is that pipe
    except FileNotFoundError:
        mode = stat.S_IFREG | 0o644
    if not stat.S_ISREG(mode):
        with open(path, "w", encoding="utf-8") as file:
            file.write(text)
        return
    path = Path(os.path.realpath(path))  # a symlink's target is replaced, not the link
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temp, stat.S_IMODE(mode))
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
