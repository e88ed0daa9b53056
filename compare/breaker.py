"""The breaker: compare mode turns itself off for the rest of a run when its harness misbehaves.

It trips on harness failures alone, never on what the paths did (a shadow path that raises or
diverges is a divergence, logged, and no reason to stop looking)::

    max_errors_in_row   that many compared ops in a row each had a harness error
    max_op_seconds      one compared op's harness time (fork, shadow, canonical forms, compare)
                        went over this many seconds

The shadow runs inline, so the breaker trips after the first op over the limit: at most one op of a
run pays more than ``max_op_seconds``.
"""

from __future__ import annotations


class BreakerWarning(RuntimeWarning):
    """Emitted when the breaker turns compare mode off: the run goes on, unchecked."""


class CompareBreaker:
    """Counts compared ops with harness errors in a row and checks each op's harness time; either
    limit may be None (no limit). Mutates only itself."""

    def __init__(self, *, max_errors_in_row: int | None, max_op_seconds: float | None) -> None:
        if max_errors_in_row is not None and max_errors_in_row < 1:
            raise ValueError(f"max_errors_in_row must be >= 1, not {max_errors_in_row!r}")
        if max_op_seconds is not None and not max_op_seconds > 0.0:
            raise ValueError(f"max_op_seconds must be > 0, not {max_op_seconds!r}")
        self.max_errors_in_row, self.max_op_seconds = max_errors_in_row, max_op_seconds
        self.errors_in_row = 0

    def trip_reason(self, num_errors: int, harness_seconds: float) -> str | None:
        """Why the op that just ran (``num_errors`` harness errors, ``harness_seconds`` of harness
        time) trips the breaker; None when it does not. Mutates the run of errors."""
        self.errors_in_row = self.errors_in_row + 1 if num_errors else 0
        limit = self.max_errors_in_row
        if limit is not None and self.errors_in_row >= limit:
            return f"{self.errors_in_row} compared ops in a row had a harness error"
        if self.max_op_seconds is not None and harness_seconds > self.max_op_seconds:
            return (
                f"one compared op took {harness_seconds:.3g} s of harness time, over the limit"
                f" of {self.max_op_seconds:g} s"
            )
        return None
