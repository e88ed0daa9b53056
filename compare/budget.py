"""A cost budget for compare mode: the sample rate moves so that comparing takes at most a fraction
of step time.

After each step the budget is told the step's seconds and compare mode's seconds in it. It keeps a
moving cost of comparing one step: an exponential average, over the compared steps, of compare's
seconds per second of the step's own work (``unit = compare / (step - compare)``). At a sample rate
``r`` compare mode's expected share of step time is then::

    share(r) = r * unit / (1 + r * unit)

    share(rate) > budget       lower the rate to the one whose share is TARGET of the budget
    share(rate) < budget / 2   raise it to that rate, never above the configured sample
    otherwise                  keep it (the band between is what keeps noise from flapping it)

Rates stay in [MIN_RATE, max_rate]. Only compared steps move the estimate, so a low rate decides
rarely and each decision rests on a measured compared step. Which steps are compared is then
timing-driven, not seeded: each change is a ``RateChange`` for the log.
"""

from __future__ import annotations

from dataclasses import dataclass

TARGET = 0.75  # a lowered or raised rate aims at this fraction of the budget
SMOOTHING = 0.3  # weight of the newest compared step in the moving cost
MIN_RATE = 1e-4  # the lowest rate the budget sets (the breaker, not the budget, turns compare off)


@dataclass(frozen=True, slots=True)
class RateChange:
    """A change of the sample rate, from ``step`` on (for the breaker: the rest of ``step`` too)."""

    step: int
    old_rate: float
    new_rate: float
    cause: str  # "budget" or "breaker"
    reason: str  # what was measured, in words
    share: float | None = None  # the moving share of step time that decided it (budget only)


class CompareBudget:
    """The sample rate that keeps compare mode's share of step time within ``budget`` (a fraction
    in (0, 1)), starting at, and never above, ``max_rate`` (the configured sample). Mutates only
    itself."""

    def __init__(self, budget: float, max_rate: float) -> None:
        if not 0.0 < budget < 1.0:
            raise ValueError(f"budget must be a fraction in (0, 1), not {budget!r}")
        if not 0.0 < max_rate <= 1.0:
            raise ValueError(f"max_rate must be in (0, 1], not {max_rate!r}")
        self.budget, self.max_rate, self.rate = budget, max_rate, max_rate
        self.unit: float | None = None  # moving compare seconds per second of a step's own work
        self.total_step_seconds = self.total_compare_seconds = 0.0

    @property
    def share(self) -> float:
        """Compare mode's measured share of step time over every step so far. Pure."""
        return (
            self.total_compare_seconds / self.total_step_seconds if self.total_step_seconds else 0.0
        )

    def expected_share(self, rate: float) -> float:
        """The moving share of step time at ``rate`` (0 before a compared step). Pure."""
        if self.unit is None:
            return 0.0
        return rate * self.unit / (1.0 + rate * self.unit)

    def end_step(
        self, step: int, step_seconds: float, compare_seconds: float, compared: bool
    ) -> RateChange | None:
        """Account for ``step`` (``compared``: whether any of its ops was), and the rate change it
        calls for, from the next step on (None: none). Mutates the totals, the moving cost and
        ``rate``."""
        self.total_step_seconds += step_seconds
        self.total_compare_seconds += compare_seconds
        work = step_seconds - compare_seconds
        if not compared or work <= 0.0:  # nothing measured, or no work to measure it against
            return None
        unit = compare_seconds / work
        self.unit = unit if self.unit is None else SMOOTHING * unit + (1 - SMOOTHING) * self.unit
        share = self.expected_share(self.rate)
        if self.budget / 2 <= share <= self.budget:
            return None
        new_rate = min(self.max_rate, max(MIN_RATE, self._rate_for(TARGET * self.budget)))
        if new_rate == self.rate:
            return None
        over = share > self.budget
        reason = (
            f"moving compare cost {share:.3%} of step time is {'over' if over else 'under half'}"
            f" the budget {self.budget:.2%}"
        )
        change = RateChange(step + 1, self.rate, new_rate, "budget", reason, share)
        self.rate = new_rate
        return change

    def _rate_for(self, share: float) -> float:
        """The rate whose expected share is ``share``, by the moving cost. Pure."""
        if not self.unit:
            return self.max_rate
        return share / (self.unit * (1.0 - share))
