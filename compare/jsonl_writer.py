"""The one durable writer of JSON Lines files: the divergence log (``compare.sink.JsonlSink``),
``batchgen run --outputs`` and ``batchgen generate``'s results all append through it.

Durability, line by line: ``write_line`` hands the whole line to the OS (``os.write`` on an
``O_APPEND`` descriptor, repeated for what a short write left) before it returns, so a process
killed at any point (SIGKILL included) leaves every line written before it intact, and at worst
the last one cut short (``cut_torn_tail`` removes such a tail before appending again). A write
that fails, or is interrupted, part way is cut back to the line's start before its error
propagates, so the next line never fuses with a partial one. ``close`` fsyncs: that part survives
a power loss. A FIFO or character device is written through: it cannot be cut or fsynced.
"""

from __future__ import annotations

import json
import os
import stat
import weakref
from pathlib import Path


class JsonLinesFile:
    """An append-only JSON Lines file, one line per ``write_line``. Mutates the file and its own
    descriptor; one writer per file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fd: int | None = None
        self.is_regular = False  # a regular file can be cut back and fsynced
        self._closer = None

    def open(self, *, readable: bool = False) -> None:
        """Open for appending, creating the file (not its directory). ``readable``: read-write, as a
        log that checks its first line is (a FIFO opened so does not wait for a reader either).
        OSError when the system refuses."""
        if self.fd is not None:
            return
        access = os.O_RDWR if readable else os.O_WRONLY
        self.fd = os.open(self.path, access | os.O_APPEND | os.O_CREAT, 0o644)
        self._closer = weakref.finalize(self, os.close, self.fd)
        self.is_regular = stat.S_ISREG(os.fstat(self.fd).st_mode)

    def truncate(self) -> None:
        """Empty a regular file (a job that starts afresh). Mutates the file."""
        if self.is_regular:
            os.ftruncate(self.fd, 0)

    def write_line(self, line: str) -> None:
        """Append ``line`` (no newline: one is added). On an error, or an interrupt, after part of
        it reached a regular file, that part is cut off again before the error propagates (the
        OSError as the system raised it)."""
        data = (line + "\n").encode()
        start = os.fstat(self.fd).st_size if self.is_regular else 0
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except BaseException:
            if self.is_regular and os.fstat(self.fd).st_size not in (start, start + len(data)):
                os.ftruncate(self.fd, start)  # part of the line made it: a full disk, a signal
            raise

    def cut_torn_tail(self) -> bytes:
        """Remove a last line that lacks its newline and is not whole JSON (a write cut short by a
        crash); end a whole one with its newline. Returns the bytes removed (b"" when none were).
        Mutates a regular file; anything else is left alone."""
        if not self.is_regular:
            return b""
        tail = last_line(self.fd)
        if not tail:
            return b""
        if is_torn(tail):
            os.ftruncate(self.fd, os.fstat(self.fd).st_size - len(tail))
            return tail
        os.write(self.fd, b"\n")
        return b""

    def close(self) -> None:
        """fsync a regular file and close it; the descriptor is closed even when the fsync raises
        (its OSError then propagates). A later ``open`` reopens it."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            self._closer.detach()
            try:
                if self.is_regular:
                    os.fsync(fd)
            finally:
                os.close(fd)


def is_torn(tail: bytes) -> bool:
    """Whether a last line without its newline is a write cut short: not UTF-8 or not whole JSON (no
    prefix of a JSON object is whole JSON). A whole JSON value is a line as written, and so is one
    nesting too deeply to parse: nothing shows it was cut short. Pure."""
    try:
        json.loads(tail.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return True
    except RecursionError:  # too deep to parse, which is no sign of a cut
        pass
    return False


def last_line(fd: int, chunk: int = 1 << 16) -> bytes:
    """The bytes after the file's last newline (b"" when it ends in one, or is empty). Reads only
    the tail."""
    end = size = os.fstat(fd).st_size
    while end > 0:
        start = max(0, end - chunk)
        block = os.pread(fd, end - start, start)
        newline = block.rfind(b"\n")
        if newline >= 0:
            return os.pread(fd, size - (start + newline + 1), start + newline + 1)
        end = start
    return os.pread(fd, size, 0)
