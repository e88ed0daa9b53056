"""Compare mode's sample rate over one run: a budget moves it, a breaker stops it.

A binding that runs ops through a `ShadowExecutor` tells the governor where it is::

    enter_step(step)   before every op (compared or not): the first op of a new step ends the
                       last one, which the budget measures (its seconds on ``clock``, the same
                       clock as the executor's) and may answer with a new rate
    before_op()        before a compared op
    after_op(step)     after it: its harness errors and harness seconds go to the breaker
    finish()           at the end of the run: the last step is measured too

Each change of the rate goes to ``on_change`` (a `RateChange`, for the log) and is set on the
executor; an open breaker sets it to 0 for the rest of the run and warns (`BreakerWarning`).
The authoritative path runs exactly as before either way: only what is compared changes.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

from compare.breaker import BreakerWarning, CompareBreaker
from compare.budget import CompareBudget, RateChange
from compare.shadow import ShadowExecutor


class SampleGovernor:
    """Moves ``executor``'s sample rate by ``budget`` and stops it by ``breaker`` (either may be
    None). Mutates the executor's sample rate and itself."""

    def __init__(
        self,
        executor: ShadowExecutor,
        *,
        budget: CompareBudget | None = None,
        breaker: CompareBreaker | None = None,
        on_change: Callable[[RateChange], None] = lambda change: None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.executor, self.budget, self.breaker = executor, budget, breaker
        self._on_change, self._clock = on_change, clock
        self.breaker_step: int | None = None  # the step whose op tripped the breaker
        self.num_steps = self.num_compared_steps = 0
        self._step: int | None = None  # the step running now
        self._step_started = self._step_compare_seconds = 0.0
        self._step_compared = False
        self._op_errors, self._op_compare_seconds = 0, 0.0

    @classmethod
    def from_limits(
        cls,
        executor: ShadowExecutor,
        *,
        budget: float | None,
        max_errors_in_row: int | None,
        max_op_seconds: float | None,
        on_change: Callable[[RateChange], None],
        clock: Callable[[], float],
    ) -> SampleGovernor | None:
        """A governor for ``executor`` with a budget (a fraction of step time, capped at the
        executor's sample rate) and a breaker, each where a limit is given; None when none is
        (the executor then samples exactly as it would alone). Pure."""
        if budget is None and max_errors_in_row is None and max_op_seconds is None:
            return None
        breaker = None
        if max_errors_in_row is not None or max_op_seconds is not None:
            breaker = CompareBreaker(
                max_errors_in_row=max_errors_in_row, max_op_seconds=max_op_seconds
            )
        return cls(
            executor,
            budget=None if budget is None else CompareBudget(budget, executor.sample_rate),
            breaker=breaker,
            on_change=on_change,
            clock=clock,
        )

    def enter_step(self, step: int) -> None:
        """Note that an op of ``step`` is about to run; on a new step, end the last one. Mutates
        self and, on a rate change, the executor."""
        if step == self._step:
            return
        now = self._clock()
        if self._step is not None:
            self._end_step(now)
        self._step, self._step_started = step, now
        self._step_compare_seconds, self._step_compared = self.executor.compare_seconds, False

    def before_op(self) -> None:
        """Note the executor's harness counters before a compared op. Mutates self."""
        self._op_errors = self.executor.num_harness_errors
        self._op_compare_seconds = self.executor.compare_seconds

    def after_op(self, step: int) -> None:
        """Give the compared op of ``step`` that just ran to the breaker; open it if the op trips
        it. Mutates self and, when it opens, the executor."""
        self._step_compared = True
        if self.breaker is None or self.breaker_step is not None:
            return
        errors = self.executor.num_harness_errors - self._op_errors
        seconds = self.executor.compare_seconds - self._op_compare_seconds
        reason = self.breaker.trip_reason(errors, seconds)
        if reason is not None:
            self.breaker_step = step
            warnings.warn(
                f"compare mode turned off from step {step} for the rest of the run: {reason}",
                BreakerWarning,
                stacklevel=3,
            )
            self._change(RateChange(step, self.executor.sample_rate, 0.0, "breaker", reason))

    def finish(self) -> None:
        """End the run's last step (measured like the others). Mutates self."""
        if self._step is not None:
            self._end_step(self._clock())
            self._step = None

    @property
    def sampled_share(self) -> float:
        """The fraction of the run's ended steps that compared an op. Pure."""
        return self.num_compared_steps / self.num_steps if self.num_steps else 0.0

    def _end_step(self, now: float) -> None:
        """The running step ended at ``now``: count it, and give it to the budget. Mutates self and,
        on a rate change, the executor."""
        self.num_steps += 1
        self.num_compared_steps += self._step_compared
        if self.budget is None:
            return
        compare_seconds = self.executor.compare_seconds - self._step_compare_seconds
        change = self.budget.end_step(
            self._step, now - self._step_started, compare_seconds, self._step_compared
        )
        if change is not None and self.breaker_step is None:
            self._change(change)

    def _change(self, change: RateChange) -> None:
        """Set the executor's rate and report the change. Mutates the executor."""
        self.executor.sample_rate = change.new_rate
        self._on_change(change)
