"""What one path produced for one operation, and how the two paths' results compared.

Both objects are immutable snapshots built by `ShadowExecutor.run_both`; nothing mutates them. A
comparison is built only when the canonical forms are not `==` or a path raised: an op whose forms
are equal is counted as matched without one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compare.coverage import OutcomeTally
from compare.diff import Diff, diff


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

    def with_value(self, value: Any) -> Observation:
        """This observation with ``value`` for its value (one that raised: as it is). Pure."""
        return self if self.raised else Observation(self.path, value, None, self.duration_s)


def as_observed(authoritative: Observation, shadow: Observation) -> tuple[Any, Any]:
    """The default canonical forms: the values the paths returned, already comparable. Pure."""
    return authoritative.value, shadow.value


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

    @property
    def exceptions(self) -> tuple[str, ...]:
        """``<path> raised <Type>: <message>`` for each side that raised, authoritative first."""
        return tuple(
            f"{seen.path} raised {exception_text(seen.exception)}"
            for seen in (self.authoritative, self.shadow)
            if seen.raised
        )


def compare_observations(
    op: str,
    step: int,
    authoritative: Observation,
    shadow: Observation,
    *,
    classify: Callable[[tuple[str, ...]], str],
    exception_kind: Callable[[BaseException], str],
    ignore: Sequence[str] = (),
) -> Comparison:
    """How two observations of one op compare: exceptions by type (the shadow's named by
    ``exception_kind`` when they differ: it is the path under test), values with ``diff`` (a
    difference named by ``classify``). Pure, but for what the namers do."""
    if authoritative.raised or shadow.raised:
        if type(authoritative.exception) is type(shadow.exception):
            return Comparison(op, step, authoritative, shadow, None, None)
        error = shadow.exception if shadow.raised else authoritative.exception
        return Comparison(op, step, authoritative, shadow, None, exception_kind(error))
    outcome = diff(authoritative.value, shadow.value, ignore=ignore)
    return Comparison(
        op, step, authoritative, shadow, outcome, None if outcome.equal else classify(outcome.paths)
    )


def exception_text(error: BaseException) -> str:
    """``Type: message``, or ``Type`` alone when the message is empty (Ctrl-C's
    ``KeyboardInterrupt``); the message is ``<unprintable>`` when the exception's own ``__str__``
    raises (a record or a warning about a failure must not fail in turn)."""
    try:
        message = str(error)
    except Exception:
        message = "<unprintable>"
    return f"{type(error).__qualname__}: {message}" if message else type(error).__qualname__


@dataclass(frozen=True, slots=True)
class ShadowStats:
    """A snapshot of an executor's counters (later runs do not change it).

    Times cover compared steps only: `authoritative_seconds` inside the authoritative callable,
    `compare_seconds` everything else the harness added (fork, shadow, canonicalize, compare).
    """

    num_compared: Mapping[str, int]  # per op
    num_divergences: Mapping[str, int]  # per op
    num_harness_errors: int
    compare_seconds: float
    authoritative_seconds: float
    coverage: Mapping[str, OutcomeTally]  # decision outcome id -> how often, first step
