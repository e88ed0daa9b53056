"""``batchgen explore``: a coverage-guided search for workloads that reach KV decisions.

Each candidate workload (``explore_space``) runs on a fresh bookkeeping-only worker (the
weightless ``NullModel``: the KV decisions depend on token counts, not on token values) in
compare mode ``raise``, plan authoritative and legacy shadowed. A candidate that reaches a
decision outcome or an interaction (``batchgen.shadow.interactions``) no earlier one reached is
kept; half the later candidates are mutations of a kept one. The search stops when every
required outcome and interaction is reached, or ``max_runs`` or the time budget is spent.

Interactions count as "new" because the bugs live where outcomes meet: a plan that checks each
victim against the host pages free before the op, or that forgets to reset a retry count on
recompute, passes on workloads that reach every single outcome. Guided by interaction coverage
rather than by killing mutants: a candidate's interactions come free with its compare-mode run,
while a mutant's verdict costs a validation (seconds each) per mutant per candidate.

The kept candidates are then cut to the fewest that reach everything the search reached (greedy
set cover, shortest runs first) and written as workload files.

A plain seeded search rather than hypothesis: the goal is a corpus of workloads that is kept and
replayed, not a failing example to shrink; a seeded loop is deterministic for a given seed and
budget in runs, and each candidate's coverage comes out of a whole compare-mode run.
A candidate that diverges is a bug found: it is kept apart, with its divergence log, and reported.

Candidates run in batches of ``BATCH`` on a sweep backend (Ray tasks or local processes,
``sweep_backends``), or one after another in this process; a batch is drawn from what the
batches before it kept, so the search is the same whatever runs it.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.config import TINY_MODELS
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import RunStalled, run_workload
from batchgen.engine.workloads import Workload
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.plan_checks import PlanRejected
from batchgen.model.null_model import NullModel
from batchgen.shadow.coverage import REQUIRED
from batchgen.shadow.wiring import gated_worker
from batchgen.sweep.backends import SweepBackend, TaskFailed
from batchgen.validation.explore_space import mutate, random_params, workload_from
from compare import DivergenceError

TINY_VOCAB = TINY_MODELS["tiny"].vocab_size  # the corpus replays on the tiny model
BATCH = 8  # candidates drawn before any of them is seen: the unit a backend runs at once
MAX_RETRIES = 2  # reruns of a candidate whose task failed (its worker died) on a backend


class ExploreError(RuntimeError):
    """A candidate's task failed on the backend in every attempt (its worker died each time):
    the search cannot go on."""


@dataclass(frozen=True)
class CandidateRun:
    """What one candidate's compare-mode run reached, and how it ended."""

    coverage: dict[str, int]  # outcome id -> times reached
    num_steps: int
    divergence: str | None = None  # the first divergence, when it diverged (a bug found)
    stalled: bool = False  # it could not finish (a fault schedule that holds the pools)


@dataclass
class Kept:
    params: dict
    workload: Workload
    run: CandidateRun
    new_outcomes: tuple[str, ...]  # what it reached first


@dataclass
class ExploreResult:
    """A finished search: what it kept, reached, missed and found."""

    kept: list[Kept]
    reached: dict[str, str]  # outcome id -> the workload that reached it first
    missed: tuple[str, ...]  # required outcomes never reached
    num_runs: int
    seconds: float
    divergences: list[tuple[Path, str]] = field(default_factory=list)  # workload file, divergence
    num_stalled: int = 0


def candidate_task(job: tuple[str, str]) -> tuple[CandidateRun, list[str]]:
    """A task of the search (picklable, for any backend): the candidate ``(workload JSON, the path
    its file has on the driver)`` run as :func:`run_candidate`, with its log's lines (nodes share
    no file system). Writes only a temporary log, removed before it returns."""
    workload_json, source = job
    workload = Workload.model_validate_json(workload_json)
    with tempfile.TemporaryDirectory(prefix="batchgen-candidate-") as scratch:
        log = Path(scratch) / "log.jsonl"
        run = run_candidate(workload, log, source)
        lines = log.read_text().splitlines(keepends=True) if log.exists() else []
    return run, lines


def run_candidate(workload: Workload, log: Path, source: str | None = None) -> CandidateRun:
    """``workload`` in compare mode ``raise`` (plan authoritative, legacy shadowed) on a fresh
    bookkeeping-only worker; its divergences go to ``log``, naming ``source`` (the workload's
    file) for replay and minimize. Mutates ``log``."""
    gate = KvGateConfig(path="plan", compare="raise", compare_log=str(log))
    faults = FaultInjector(FaultSpec.parse(workload.faults)) if workload.faults else None
    worker = gated_worker(
        NullModel(TINY_MODELS["tiny"]), cache_config=workload.cache, engine_config=workload.engine,
        kv_gate=gate, faults=faults, kv_storage=False,
    )  # fmt: skip
    divergence, stalled = None, False
    try:
        run_workload(worker, workload, source=source or workload.name, max_steps=20_000)
    except (DivergenceError, PlanRejected) as error:
        divergence = str(error).splitlines()[0]
    except RunStalled:
        stalled = True
    finally:
        worker.kv_compare.sink.close()
    summary = worker.kv_compare.end_run()
    coverage = {outcome: tally.count for outcome, tally in summary.coverage.items()}
    return CandidateRun(coverage, worker.state.step, divergence, stalled)


def explore(
    *,
    seed: int = 0,
    max_runs: int = 400,
    time_budget: float | None = None,
    required: Iterable[str] = REQUIRED,
    on_run: Callable[[int, int], None] | None = None,
    log_dir: Path | None = None,
    backend: SweepBackend | None = None,
    on_log: Callable[[list[str]], None] | None = None,
    prefix_caching: bool | None = None,
) -> ExploreResult:
    """Search until every outcome and interaction of ``required`` is reached or the budget is
    spent. ``on_run(runs done, ids reached)`` reports progress; a diverging candidate's workload
    file and log go to ``log_dir`` (a temporary directory when None); ``backend`` runs the
    candidates (None: this process); ``on_log(lines)`` gets each candidate's log lines (the
    metrics' sums); ``prefix_caching`` is every candidate's (None: the candidates' own, off)."""
    rng, required, started = random.Random(seed), set(required), time.monotonic()
    result = ExploreResult([], {}, (), 0, 0.0)
    with tempfile.TemporaryDirectory(prefix="batchgen-explore-") as scratch:
        logs = Path(log_dir or scratch)
        while result.num_runs < max_runs and not required <= result.reached.keys():
            if time_budget is not None and time.monotonic() - started > time_budget:
                break
            size = min(BATCH, max_runs - result.num_runs)
            batch = [_draw(result.kept, rng) for _ in range(size)]
            names = [f"explore-{seed}-{result.num_runs + i}" for i in range(size)]
            workloads = [_candidate(p, n, prefix_caching) for p, n in zip(batch, names)]
            _run_batch(result, batch, workloads, logs, backend, on_log)
            if on_run is not None:
                on_run(result.num_runs, len(result.reached))
    result.missed = tuple(sorted(required - result.reached.keys()))
    result.seconds = time.monotonic() - started
    return result


def _candidate(params: dict, name: str, prefix_caching: bool | None) -> Workload:
    """The candidate workload of ``params``, with ``prefix_caching`` when given. Pure."""
    workload = workload_from(params, name=name, vocab_size=TINY_VOCAB)
    if prefix_caching is None:
        return workload
    return workload.with_cache(enable_prefix_caching=prefix_caching)


def _run_batch(
    result: ExploreResult, batch: list[dict], workloads: list[Workload], logs: Path, backend, on_log
) -> None:
    """Run one batch of candidates and take each in draw order (``_take``). Mutates ``result``."""
    names = [workload.name for workload in workloads]
    jobs = [(w.model_dump_json(), str((logs / f"{w.name}.json").resolve())) for w in workloads]
    outcomes: dict[int, tuple[CandidateRun, list[str]]] = {}
    if backend is None:
        outcomes = dict(enumerate(map(candidate_task, jobs)))
    else:

        def on_done(index: int, outcome) -> None:
            if isinstance(outcome, TaskFailed):
                raise ExploreError(
                    f"candidate {names[index]} failed in {outcome.num_attempts} attempts on the"
                    f" backend, the last with: {outcome.error}"
                )
            outcomes[index] = outcome.value

        backend.map_runs(candidate_task, jobs, on_done, max_retries=MAX_RETRIES)
    for i in sorted(outcomes):
        _take(result, batch[i], workloads[i], *outcomes[i], logs)
        if on_log is not None:
            on_log(outcomes[i][1])


def _draw(kept: list[Kept], rng: random.Random) -> dict:
    """A mutation of a kept candidate half the time (once there is one), else a fresh one."""
    if kept and rng.random() < 0.5:
        return mutate(rng.choice(kept).params, rng)
    return random_params(rng)


def _take(
    result: ExploreResult, params: dict, workload: Workload, run: CandidateRun, log_lines, logs
) -> None:
    """Count one candidate's run; keep it when it reached something new, cleanly. A diverging
    one's workload file and log are written to ``logs``. Mutates ``result`` and ``logs``."""
    result.num_runs += 1
    if run.divergence is not None:
        logs.mkdir(parents=True, exist_ok=True)
        path = logs / f"{workload.name}.json"
        path.write_text(workload.to_json())
        path.with_suffix(".jsonl").write_text("".join(log_lines))
        result.divergences.append((path, run.divergence))
        return
    if run.stalled:
        result.num_stalled += 1
        return
    new = tuple(sorted(set(run.coverage) - result.reached.keys()))
    if new:
        result.kept.append(Kept(params, workload, run, new))
        result.reached.update(dict.fromkeys(new, workload.name))


def smallest_cover(kept: list[Kept]) -> list[Kept]:
    """The fewest kept candidates that together reach every outcome any of them reached: greedy,
    most new outcomes first, then fewest steps. Pure."""
    left = {outcome for candidate in kept for outcome in candidate.run.coverage}
    chosen: list[Kept] = []
    while left:
        best = max(kept, key=lambda c: (len(left & c.run.coverage.keys()), -c.run.num_steps))
        chosen.append(best)
        left -= best.run.coverage.keys()
    return chosen


def write_corpus(cover: list[Kept], directory: Path) -> list[Path]:
    """Each workload of ``cover`` as ``corpus-NN.json`` in ``directory`` (created; an earlier
    corpus's files are replaced). Mutates the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("corpus-*.json"):
        old.unlink()
    written = []
    for number, candidate in enumerate(cover):
        name = f"corpus-{number:02d}"
        path = directory / f"{name}.json"
        workload = candidate.workload.model_copy(update={"name": name})
        path.write_text(workload.to_json())
        written.append(path)
    return written
