"""What one path produced for one operation, and how the two paths' results compared.

Both objects are immutable snapshots built by `ShadowExecutor.run`; nothing mutates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compare.diff import Diff


@dataclass(frozen=True, slots=True)
class Observation:
    """One path's outcome: its canonical value, or the exception it raised, and how long it took."""

    path: str  # which path ran, e.g. "legacy" or "plan"
    value: Any = None  # canonical form; None when the path raised
    exception: BaseException | None = None
    duration_s: float = 0.0

    @property
    def raised(self) -> bool:
        return self.exception is not None


@dataclass(frozen=True, slots=True)
class Comparison:
    """The authoritative and shadow observations of one compared step of one op.

    `kind` is None when the paths agree; otherwise it names the divergence ("state", "copies",
    "exception", "invalid_plan", or whatever the executor's classifier returns). `diff` is None
    when either side raised (exceptions are compared by type, not by value).
    """

    op: str
    step: int
    authoritative: Observation
    shadow: Observation
    diff: Diff | None
    kind: str | None

    @property
    def matched(self) -> bool:
        return self.kind is None

    @property
    def field_paths(self) -> tuple[str, ...]:
        return self.diff.paths if self.diff is not None else ()


def exception_text(error: BaseException) -> str:
    """``Type: message``; the message is ``<unprintable>`` when the exception's own ``__str__`` raises (a
    record or a warning about a failure must not fail in turn)."""
    try:
        message = str(error)
    except Exception:
        message = "<unprintable>"
    return f"{type(error).__qualname__}: {message}"
