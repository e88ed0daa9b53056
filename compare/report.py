"""Aggregate divergence logs into one immutable report (``compare.render`` renders it).

Divergences are counted per op and per (op, field path with ids and indexes wildcarded):
`requests[r17].gpu_pages[3]` and `requests[r4].gpu_pages[0]` both count under
`requests[*].gpu_pages[*]`. A divergence without field paths (an exception) counts under
`<kind>`, e.g. `<exception>`. Compared-op counts and decision coverage come from the runs'
`RunSummary` records; coverage is listed against the binding's catalog, when one is given.

    aggregate(records, catalog) -> Report -> render_text / render_markdown / render_junit / ...
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from compare.canonical import wildcard
from compare.coverage import CoverageRow, Outcome, RunTallies, coverage_rows, unexpected, unreached
from compare.explain import Row, explain_record
from compare.records import DivergenceRecord, LogRecord, RunSummary

MAX_SAMPLES = 3  # concrete examples kept per (op, field path)
MAX_SAMPLE_ROWS = 4  # rows of values kept per example; the rest are counted


@dataclass(frozen=True, slots=True)
class PathSample:
    """One concrete occurrence of a wildcarded field path, with each side's values."""

    run_id: str
    workload: str
    step: int
    path: str  # concrete, e.g. "requests[r17].gpu_pages[3]"
    # the divergence's rows under the wildcarded path (compare.explain), the first MAX_SAMPLE_ROWS
    rows: tuple[Row, ...] = ()
    more_rows: int = 0  # its rows left out

    @classmethod
    def of(cls, record: DivergenceRecord, paths: list[str]) -> PathSample:
        """The sample of ``record``'s ``paths`` (concrete, under one wildcarded path; none: a
        divergence without field paths). Pure."""
        rows = explain_record(record, paths if record.field_paths else None)
        return cls(
            record.run_id, record.workload, record.step, paths[0], tuple(rows[:MAX_SAMPLE_ROWS]),
            max(0, len(rows) - MAX_SAMPLE_ROWS),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class PathStats:
    """Divergences of one op at one wildcarded field path."""

    op: str
    path: str  # wildcarded, e.g. "requests[*].gpu_pages[*]"
    count: int  # divergence records touching the path
    first_step: int
    last_step: int
    workloads: tuple[str, ...]
    kinds: tuple[str, ...]
    samples: tuple[PathSample, ...]  # the first MAX_SAMPLES, in log order


@dataclass(frozen=True, slots=True)
class OpStats:
    op: str
    num_compared: int
    num_divergences: int


@dataclass(frozen=True, slots=True)
class PairStats:
    """One (workload, op) pair: a JUnit test case."""

    workload: str
    op: str
    num_compared: int
    num_divergences: int
    top_paths: tuple[tuple[str, int], ...]  # (wildcarded path, count), most frequent first
    samples: tuple[PathSample, ...] = ()  # the first divergence at each of top_paths, in order


@dataclass(frozen=True, slots=True)
class Report:
    num_runs: int  # RunSummary records read
    num_compared: int
    num_divergences: int
    num_harness_errors: int
    compare_seconds: float
    authoritative_seconds: float
    ops: tuple[OpStats, ...]  # by op name
    paths: tuple[PathStats, ...]  # most frequent first
    pairs: tuple[PairStats, ...]  # by workload, then op
    coverage: tuple[CoverageRow, ...] = ()  # the catalog's outcomes of compared ops, then others
    unreached: tuple[str, ...] = ()  # required outcomes of compared ops that no run reached
    unexpected: tuple[str, ...] = ()  # outcomes reached that the catalog rules out or lacks
    kinds: tuple[tuple[str, int], ...] = ()  # (kind, divergences), by kind
    # the runs' data oracles (RunSummary.data), summed: (check, units checked), (pattern id, count)
    data_checked: tuple[tuple[str, int], ...] = ()
    data_patterns: tuple[tuple[str, int], ...] = ()
    data_seconds: float = 0.0  # the data oracles' own time


@dataclass(slots=True)
class _PathTally:
    """Accumulates one PathStats while `aggregate` reads records (local to one call)."""

    count: int = 0
    first_step: int = 0
    last_step: int = 0
    workloads: set[str] = field(default_factory=set)
    kinds: set[str] = field(default_factory=set)
    samples: list[PathSample] = field(default_factory=list)

    def add(self, record: DivergenceRecord, concrete: list[str]) -> None:
        """Count one divergence touching this path at ``concrete`` paths. Mutates the tally."""
        if not self.count:
            self.first_step = self.last_step = record.step
        self.count += 1
        self.first_step = min(self.first_step, record.step)
        self.last_step = max(self.last_step, record.step)
        self.workloads.add(record.workload)
        self.kinds.add(record.kind)
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(PathSample.of(record, concrete))

    def stats(self, op: str, path: str) -> PathStats:
        workloads, kinds = tuple(sorted(self.workloads)), tuple(sorted(self.kinds))
        return PathStats(
            op, path, self.count, self.first_step, self.last_step, workloads, kinds,
            tuple(self.samples),
        )  # fmt: skip


class _Aggregation:
    """What `aggregate` accumulates while it reads records (local to one call)."""

    def __init__(self) -> None:
        self.compared: Counter[tuple[str, str]] = Counter()  # (workload, op) -> compared ops
        self.diverged: Counter[tuple[str, str]] = Counter()
        self.pair_paths: dict[tuple[str, str], Counter[str]] = {}
        # (workload, op, wildcarded path) -> its first divergence
        self.pair_samples: dict[tuple[str, str, str], PathSample] = {}
        self.paths: dict[tuple[str, str], _PathTally] = {}  # (op, wildcarded path)
        self.runs: list[RunSummary] = []
        self.kinds: Counter[str] = Counter()
        self.data_checked: Counter[str] = Counter()
        self.data_patterns: Counter[str] = Counter()

    def add(self, record: LogRecord) -> None:
        """Count one record. Mutates the aggregation."""
        if isinstance(record, RunSummary):
            self.runs.append(record)
            for op, num_compared in record.steps_compared.items():
                self.compared[(record.workload, op)] += num_compared
            if record.data is not None:
                self.data_checked.update(record.data.checked)
                self.data_patterns.update(record.data.patterns)
            return
        if not isinstance(record, DivergenceRecord):  # a sample rate change: counts nothing
            return
        pair = (record.workload, record.op)
        self.diverged[pair] += 1
        self.kinds[record.kind] += 1
        concrete_by_key: dict[str, list[str]] = {}
        for path in record.field_paths or [f"<{record.kind}>"]:
            concrete_by_key.setdefault(wildcard(path), []).append(path)
        self.pair_paths.setdefault(pair, Counter()).update(concrete_by_key.keys())
        for key, concrete in concrete_by_key.items():
            self.paths.setdefault((record.op, key), _PathTally()).add(record, concrete)
            if (*pair, key) not in self.pair_samples:
                self.pair_samples[(*pair, key)] = PathSample.of(record, concrete)

    def op_stats(self) -> tuple[OpStats, ...]:
        ops = sorted({op for _, op in self.compared.keys() | self.diverged.keys()})
        return tuple(
            OpStats(op, _sum_for(self.compared, op), _sum_for(self.diverged, op)) for op in ops
        )

    def pair_stats(self) -> tuple[PairStats, ...]:
        stats = []
        for workload, op in sorted(self.compared.keys() | self.diverged.keys()):
            top = _most_common(self.pair_paths.get((workload, op), Counter()))
            samples = tuple(self.pair_samples[(workload, op, path)] for path, _ in top)
            pair = (workload, op)
            stats.append(PairStats(*pair, self.compared[pair], self.diverged[pair], top, samples))
        return tuple(stats)


def aggregate(records: Iterable[LogRecord], catalog: Sequence[Outcome] = ()) -> Report:
    """Count divergences and compared ops per op, per field path and per (workload, op), and the
    decision coverage over every run against ``catalog`` (the binding's outcomes). Pure."""
    seen = _Aggregation()
    for record in records:
        seen.add(record)
    runs = seen.runs
    paths = [tally.stats(op, path) for (op, path), tally in seen.paths.items()]
    paths.sort(key=lambda stats: (-stats.count, stats.op, stats.path))
    ops = seen.op_stats()
    compared_ops = [stats.op for stats in ops if stats.num_compared]
    rows = coverage_rows([RunTallies(r.workload, r.coverage) for r in runs], catalog, compared_ops)
    return Report(
        num_runs=len(runs),
        num_compared=sum(seen.compared.values()),
        num_divergences=sum(seen.diverged.values()),
        num_harness_errors=sum(run.harness_errors for run in runs),
        compare_seconds=sum(run.compare_seconds for run in runs),
        authoritative_seconds=sum(run.authoritative_seconds for run in runs),
        ops=ops,
        paths=tuple(paths),
        pairs=seen.pair_stats(),
        coverage=rows,
        unreached=unreached(rows),
        unexpected=unexpected(rows),
        kinds=tuple(sorted(seen.kinds.items())),
        data_checked=tuple(sorted(seen.data_checked.items())),
        data_patterns=tuple(sorted(seen.data_patterns.items())),
        data_seconds=sum(run.data.seconds for run in runs if run.data is not None),
    )


def _sum_for(counts: Counter[tuple[str, str]], op: str) -> int:
    return sum(n for (_, counted_op), n in counts.items() if counted_op == op)


def _most_common(counts: Counter[str]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(counts.items(), key=lambda item: (-item[1], item[0])))
