"""Decision coverage: which outcomes of the compared code a run reached, and how often.

"0 divergences" is only as strong as the decisions the compared ops took. A binding names each
outcome and boundary of its policy in a catalog (:class:`Outcome`), classifies every compared op
into the outcomes it reached (``ShadowExecutor``'s ``outcomes`` hook), and the executor counts
them (:class:`CoverageCounter`): how many times each, and the first step that reached it. Run
summaries carry the counts; :func:`coverage_rows` merges them over many runs against the catalog,
so a report can say which outcomes were compared and which never were. Interactions (where
outcomes meet: in sequence inside one op, after a history, across the ops of one step) are
catalog entries of ``kind`` "interaction", counted the same way and reported apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Outcome:
    """One outcome or boundary of the compared policy, as a binding's catalog lists it."""

    id: str  # stable, dotted, starting with its op: "alloc.exact_fit"
    op: str
    meaning: str
    unreachable: str | None = None  # why no run can reach it (and what covers it); None: required
    # "outcome": one decision; "interaction": outcomes met in one op, after a history, or across
    # the ops of one step (counted and required alike, reported apart)
    kind: str = "outcome"


@dataclass(frozen=True, slots=True)
class OutcomeTally:
    """How often one run reached one outcome, and the first step that did."""

    count: int
    first_step: int


class CoverageCounter:
    """Counts outcome ids as compared ops reach them. Mutates only itself."""

    def __init__(self) -> None:
        self._tallies: dict[str, list[int]] = {}  # id -> [count, first step]

    def add(self, outcome_ids: Iterable[str], step: int) -> None:
        """Count each of ``outcome_ids`` once at ``step``. Mutates the counter."""
        for outcome_id in outcome_ids:
            tally = self._tallies.get(outcome_id)
            if tally is None:
                self._tallies[outcome_id] = [1, step]
            else:
                tally[0] += 1

    def tallies(self) -> dict[str, OutcomeTally]:
        """A snapshot: outcome id -> its tally, ids sorted."""
        return {i: OutcomeTally(*self._tallies[i]) for i in sorted(self._tallies)}


@dataclass(frozen=True, slots=True)
class CoverageRow:
    """One outcome over every run a report read."""

    outcome: str
    op: str
    count: int  # compared ops that reached it, over all runs
    num_runs: int  # runs that reached it
    first_workload: str | None  # where it was first reached (in log order); None: never
    first_step: int | None
    required: bool  # in the catalog and reachable
    unreachable: str | None  # the catalog's reason, for an outcome no run can reach
    meaning: str
    kind: str = "outcome"  # the catalog's (Outcome.kind); "outcome" for one it does not list


@dataclass(frozen=True, slots=True)
class RunTallies:
    """What ``coverage_rows`` reads of one run: its workload and tallies."""

    workload: str
    tallies: Mapping[str, OutcomeTally]


def coverage_rows(
    runs: Sequence[RunTallies], catalog: Sequence[Outcome], compared_ops: Iterable[str]
) -> tuple[CoverageRow, ...]:
    """Every catalog outcome of an op in ``compared_ops``, then any other outcome a run reached,
    merged over ``runs`` (in order). Pure."""
    ops = set(compared_ops)
    known = {outcome.id: outcome for outcome in catalog}
    reached: dict[str, list] = {}  # id -> [count, runs, first workload, first step]
    for run in runs:
        for outcome_id, tally in run.tallies.items():
            entry = reached.setdefault(outcome_id, [0, 0, run.workload, tally.first_step])
            entry[0] += tally.count
            entry[1] += 1
    listed = [o.id for o in catalog if o.op in ops] + sorted(set(reached) - set(known))
    rows = []
    for outcome_id in listed:
        outcome = known.get(outcome_id)
        count, num_runs, workload, step = reached.get(outcome_id, (0, 0, None, None))
        rows.append(
            CoverageRow(
                outcome=outcome_id,
                op=outcome.op if outcome else outcome_id.partition(".")[0],
                count=count,
                num_runs=num_runs,
                first_workload=workload,
                first_step=step,
                required=outcome is not None and outcome.unreachable is None,
                unreachable=outcome.unreachable if outcome else None,
                meaning=outcome.meaning if outcome else "(not in the catalog)",
                kind=outcome.kind if outcome else "outcome",
            )
        )
    return tuple(rows)


def unreached(rows: Iterable[CoverageRow]) -> tuple[str, ...]:
    """The required outcomes no run reached. Pure."""
    return tuple(row.outcome for row in rows if row.required and not row.count)


def unexpected(rows: Iterable[CoverageRow]) -> tuple[str, ...]:
    """Outcomes reached that the catalog says no run can reach, or does not list. Pure."""
    return tuple(row.outcome for row in rows if row.count and not row.required)
