"""Drive a worker through a workload: arrivals, aborts, steps, and the result.

Arrival and abort steps are relative to the step the run starts at, so one worker can run
several workloads back to back. However a run ends (finished, stalled, a divergence in raise
mode, Ctrl-C), a caller's ``on_release`` has seen every request released before it stopped, its
timeline recorder holds every step it ran, and in compare mode a run summary closes its log.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields

from batchgen.engine.timeline import TimelineRecorder
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import MAX_STEPS, Workload
from batchgen.state import RequestOutput, WorkerStats
from compare import RunSummary, Timeline, exception_text


@dataclass(frozen=True, slots=True)
class RunResult:
    workload: str
    outputs: dict[str, RequestOutput]
    num_steps: int
    wall_s: float
    stats: WorkerStats  # this run's counters (peaks: over the worker's life)
    leaked_gpu_pages: int
    leaked_host_pages: int
    loads_in_flight: int
    live_requests: int
    timeline: Timeline  # pages held and KV events per step (batchgen.engine.timeline)
    compare_summary: RunSummary | None = None

    @property
    def tokens_generated(self) -> int:
        return self.stats.tokens_generated

    def summary(self) -> dict:
        return {
            "workload": self.workload,
            "requests": len(self.outputs),
            "steps": self.num_steps,
            "wall_s": round(self.wall_s, 3),
            "tokens_generated": self.tokens_generated,
            "tokens_per_s": round(self.tokens_generated / self.wall_s, 1) if self.wall_s else 0.0,
            "evictions": self.stats.evictions,
            "loads": self.stats.loads,
            "load_failures": self.stats.load_failures,
            "recompute_preemptions": self.stats.recompute_preemptions,
            "prefix_cache_queries": self.stats.prefix_cache_queries,
            "prefix_cache_hits": self.stats.prefix_cache_hits,
            "peak_gpu_pages": self.stats.peak_gpu_pages,
            "peak_host_pages": self.stats.peak_host_pages,
            "leaked_gpu_pages": self.leaked_gpu_pages,
            "leaked_host_pages": self.leaked_host_pages,
            "loads_in_flight": self.loads_in_flight,
        }


class RunStalled(RuntimeError):
    """A run that cannot finish: no progress for too long, or past its step limit."""


MAX_IDLE_STEPS = 10_000  # steps with live requests and no progress before a run is called stalled


def _progress(worker: Worker) -> tuple[int, ...]:
    """What changes whenever a step gets anywhere: tokens, releases, and every KV event counter.
    Pure."""
    stats = worker.state.stats
    return (
        stats.tokens_generated,
        len(worker.state.outputs),
        stats.evictions,
        stats.loads,
        stats.load_failures,
        stats.recompute_preemptions,
    )


def _stalled_message(worker: Worker, workload: Workload, why: str, hint: str) -> str:
    """Why the run stopped, then what is live: requests by phase, free GPU pages, and ``hint``.
    Pure."""
    phases = Counter(req.phase.value for req in worker.state.requests.values())
    live = ", ".join(f"{count} {phase}" for phase, count in sorted(phases.items()))
    return (
        f"{workload.name}: {why} with {len(worker.state.requests)} requests live ({live}), "
        f"{worker.gpu_kv.free_pages()} of {worker.gpu_kv.num_pages} GPU pages free ({hint})"
    )


def _report_releases(
    worker: Worker, uuids: set[str], num_new: int, on_release: Callable[[RequestOutput], None]
) -> None:
    """``on_release`` for each of ``uuids`` among the ``num_new`` outputs the last step added (the
    newest, at the end of ``state.outputs``: released requests are appended in release order),
    oldest first."""
    outputs = worker.state.outputs
    newest = list(itertools.islice(reversed(outputs), num_new))
    for uuid in reversed(newest):
        if uuid in uuids:
            on_release(outputs[uuid])


class _Arrivals:
    """A workload's arrivals and aborts, due at steps relative to the run's first step."""

    def __init__(self, workload: Workload):
        self.arrivals = sorted(workload.requests, key=lambda r: r.arrival_step)
        self.aborts = sorted(
            (r.arrival_step + r.abort_step, r.uuid)
            for r in workload.requests
            if r.abort_step is not None
        )
        self.next_arrival = self.next_abort = 0

    @property
    def pending(self) -> bool:
        return self.next_arrival < len(self.arrivals)

    def last_step(self) -> int:
        return max((r.arrival_step for r in self.arrivals), default=0)

    def submit_due(self, worker: Worker, step: int) -> None:
        """Add the requests arriving by ``step`` and abort those due, if still live. Mutates
        ``worker``."""
        arrivals, aborts = self.arrivals, self.aborts
        while (
            self.next_arrival < len(arrivals) and arrivals[self.next_arrival].arrival_step <= step
        ):
            worker.add_request(arrivals[self.next_arrival].to_request())
            self.next_arrival += 1
        while self.next_abort < len(aborts) and aborts[self.next_abort][0] <= step:
            uuid = aborts[self.next_abort][1]
            if uuid in worker.state.requests:
                worker.abort(uuid)
            self.next_abort += 1


def _check_not_stalled(
    worker: Worker, workload: Workload, step: int, max_steps: int, idle: tuple[int, int]
) -> None:
    """RunStalled when ``step`` (relative) reached ``max_steps``, or the ``idle`` steps (done,
    allowed) ran out. Pure."""
    idle_steps, max_idle_steps = idle
    if idle_steps >= max_idle_steps:
        why = f"no progress in {idle_steps} steps (no token, release, eviction, load or preemption)"
        hint = "an injected fault holding the pools, such as gpu_refuse=1, can do this"
        raise RunStalled(_stalled_message(worker, workload, why, hint))
    if step >= max_steps:
        why = f"not done after {max_steps} steps (the limit: its last arrival step + {MAX_STEPS})"
        hint = "a load that never lands under a long --kv-load-timeout-steps can do this"
        raise RunStalled(_stalled_message(worker, workload, why, hint))


def run_workload(
    worker: Worker,
    workload: Workload,
    *,
    check_integrity: bool = False,
    on_step: Callable[[int, int], None] | None = None,
    max_steps: int | None = None,
    source: str | None = None,
    scale: float = 1.0,
    on_release: Callable[[RequestOutput], None] | None = None,
    run_id: str | None = None,
    recorder: TimelineRecorder | None = None,
    metrics=None,
) -> RunResult:
    """Submit ``workload`` at its arrival steps and step until every request is released (see
    the module docstring). Mutates the worker and ``recorder`` (a new one when None).
    ``on_step(num_released, num_requests)`` reports progress; ``on_release(output)`` gets each of
    the workload's requests once, after the step that released it, in release order. In compare
    mode, the divergences name ``source`` (the workload's name or file) and ``run_id`` (default:
    random). RunStalled past ``max_steps`` (default: the last arrival step plus ``MAX_STEPS``) or
    after ``MAX_IDLE_STEPS`` steps without progress (or twice the load timeout, if longer).
    ``metrics`` (a ``batchgen.metrics.WorkerMetrics``) watches the run: its counters after each
    step, its requests' latencies."""
    on_step, on_release = _begin(
        worker, workload, metrics, (on_step, on_release), source=source, scale=scale, run_id=run_id
    )
    compare, recorder = worker.kv_compare, recorder or TimelineRecorder(worker)
    start_step, before, started = worker.state.step, worker.state.stats.copy(), time.perf_counter()
    uuids = {r.uuid for r in workload.requests}
    finish = worker.finish_compare  # the finish step's compare mode: a run per workload too
    opened = finish.begin_run(workload.name, seed=workload.seed, run_id=run_id) if finish else None
    # both compare logs get the run's summary however it ends, saying why it stopped early
    with _summary_on_error(compare, recorder), opened or contextlib.nullcontext():
        _drive(worker, workload, uuids, recorder, max_steps, check_integrity, on_step, on_release)
    wall, timeline = time.perf_counter() - started, recorder.timeline()
    return RunResult(
        workload=workload.name,
        outputs={u: worker.state.outputs[u] for u in uuids},
        num_steps=worker.state.step - start_step,
        wall_s=wall,
        stats=_stats_since(before, worker.state.stats),
        timeline=timeline,
        compare_summary=compare.end_run(timeline=timeline) if compare is not None else None,
        **_left_behind(worker),
    )


@contextlib.contextmanager
def _summary_on_error(compare, recorder: TimelineRecorder):
    """On an exception inside (a stall, a divergence in raise mode, Ctrl-C), compare mode's log
    (``compare``, when on) gets the run's summary naming it, then the exception goes on. Mutates
    the log."""
    try:
        yield
    except BaseException as error:
        if compare is not None:
            with contextlib.suppress(Exception):  # the run's own error is the one to report
                compare.end_run(stopped_by=exception_text(error), timeline=recorder.timeline())
        raise


def _begin(worker: Worker, workload: Workload, metrics, callbacks: tuple, **run) -> tuple:
    """Open the run: in compare mode its log entry (``run``: source, scale, run_id), then the
    workload's requests checked (a bad one refused before any step runs), then ``metrics``
    watching it. Returns ``callbacks`` (on_step, on_release), chained with the metrics' when
    watched. Mutates the worker's compare state and ``metrics``."""
    if worker.kv_compare is not None:
        worker.kv_compare.begin_run(workload.name, seed=workload.seed, **run)
    for req in workload.requests:
        worker.validate_request(req.to_request())
    if metrics is None:
        return callbacks
    return metrics.begin_run(worker, workload.name, workload.requests).chain(*callbacks)


def _left_behind(worker: Worker) -> dict[str, int]:
    """What a finished run left on the worker: pages held, loads in flight, live requests. Pure."""
    return {
        "leaked_gpu_pages": worker.gpu_kv.num_pages - worker.gpu_kv.free_pages(),
        "leaked_host_pages": worker.host_kv.num_pages - worker.host_kv.free_pages(),
        "loads_in_flight": sum(r.load_handle is not None for r in worker.state.requests.values()),
        "live_requests": len(worker.state.requests),
    }


def _drive(
    worker: Worker,
    workload: Workload,
    uuids: set[str],
    recorder: TimelineRecorder,
    max_steps: int | None,
    check_integrity: bool,
    on_step: Callable[[int, int], None] | None,
    on_release: Callable[[RequestOutput], None] | None,
) -> None:
    """Step ``worker`` until ``workload`` is done (``run_workload``'s loop). Mutates ``worker``
    and ``recorder``."""
    start_step, arrivals = worker.state.step, _Arrivals(workload)
    if max_steps is None:
        max_steps = arrivals.last_step() + MAX_STEPS
    max_idle_steps = max(MAX_IDLE_STEPS, 2 * worker.engine_config.load_timeout_steps)
    idle_steps, progress = 0, _progress(worker)
    while arrivals.pending or worker.has_unfinished():
        step = worker.state.step - start_step
        _check_not_stalled(worker, workload, step, max_steps, (idle_steps, max_idle_steps))
        arrivals.submit_due(worker, step)
        _step(worker, uuids, on_release)
        recorder.record(worker)
        progress, before_step = _progress(worker), progress
        idle_steps = idle_steps + 1 if progress == before_step and worker.state.requests else 0
        if check_integrity:
            worker.check_integrity()
        if on_step is not None:
            on_step(sum(u in worker.state.outputs for u in uuids), len(uuids))


def _step(
    worker: Worker, uuids: set[str], on_release: Callable[[RequestOutput], None] | None
) -> None:
    """One worker step, then ``on_release`` for what it released, also when the step raised (a
    divergence in raise mode, Ctrl-C: it may have released requests already). Mutates ``worker``."""
    num_outputs = len(worker.state.outputs)
    try:
        worker.step()
    finally:
        if on_release is not None:
            _report_releases(worker, uuids, len(worker.state.outputs) - num_outputs, on_release)


def _stats_since(before: WorkerStats, after: WorkerStats) -> WorkerStats:
    """The counters a run added (peaks: ``after``'s, over the worker's life). Pure."""
    delta = WorkerStats(
        **{f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(WorkerStats)}
    )
    delta.peak_gpu_pages, delta.peak_host_pages = after.peak_gpu_pages, after.peak_host_pages
    return delta
