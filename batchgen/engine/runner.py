"""Drive a worker through a workload: arrivals, aborts, steps, and the result.

Arrival and abort steps are relative to the step the run starts at, so one
worker can run several workloads back to back.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields

from batchgen.engine.state import RequestOutput, WorkerStats
from batchgen.engine.timeline import TimelineRecorder
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import MAX_STEPS, Workload
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
) -> RunResult:
    """Submit ``workload`` at its arrival steps and step until every request is released.

    Mutates the worker. ``on_step(num_released, num_requests)`` reports progress;
    ``on_release(output)`` gets each of the workload's requests once, after the step
    that released it, in release order (so a run that stops early has reported every
    request released before it stopped). ``recorder`` gets every step's counters (a
    new one when None; a caller keeps what its own recorded, made just before the
    call, however the run ends).
    In compare mode the run is one compare run: its divergences carry the
    workload's name, seed and ``source`` (name or file, for replay/minimize), and a
    summary record closes it, however the run ends; ``run_id`` names the compare run (default:
    random, see ``KvCompare.begin_run``). Raises :class:`RunStalled` past
    ``max_steps`` (default: the last arrival step plus ``MAX_STEPS``), or when requests
    are live and nothing progresses for ``MAX_IDLE_STEPS`` steps (or twice the load
    timeout, if longer: a hung load is failed after that).
    """
    if worker.kv_compare is not None:
        worker.kv_compare.begin_run(
            workload.name, seed=workload.seed, source=source, scale=scale, run_id=run_id
        )
    for req in workload.requests:  # reject a bad workload before any step runs
        worker.validate_request(req.to_request())
    start_step = worker.state.step
    if recorder is None:
        recorder = TimelineRecorder(worker)
    before = worker.state.stats.copy()
    arrivals = sorted(workload.requests, key=lambda r: r.arrival_step)
    if max_steps is None:
        max_steps = max((r.arrival_step for r in arrivals), default=0) + MAX_STEPS
    aborts = sorted(
        (r.arrival_step + r.abort_step, r.uuid)
        for r in workload.requests
        if r.abort_step is not None
    )
    uuids = {r.uuid for r in workload.requests}
    started = time.perf_counter()
    next_arrival = next_abort = idle_steps = 0
    max_idle_steps = max(MAX_IDLE_STEPS, 2 * worker.engine_config.load_timeout_steps)
    progress = _progress(worker)
    try:
        while next_arrival < len(arrivals) or worker.has_unfinished():
            rel = worker.state.step - start_step
            if rel >= max_steps or idle_steps >= max_idle_steps:
                if idle_steps >= max_idle_steps:
                    raise RunStalled(
                        _stalled_message(
                            worker,
                            workload,
                            f"no progress in {idle_steps} steps (no token, release, eviction, load"
                            " or preemption)",
                            "an injected fault holding the pools, such as gpu_refuse=1, can do"
                            " this",
                        )
                    )
                raise RunStalled(
                    _stalled_message(
                        worker,
                        workload,
                        f"not done after {max_steps} steps (the limit: its last arrival step + "
                        f"{MAX_STEPS})",
                        "a load that never lands under a long --kv-load-timeout-steps can do this",
                    )
                )
            while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_step <= rel:
                worker.add_request(arrivals[next_arrival].to_request())
                next_arrival += 1
            while next_abort < len(aborts) and aborts[next_abort][0] <= rel:
                uuid = aborts[next_abort][1]
                if uuid in worker.state.requests:
                    worker.abort(uuid)
                next_abort += 1
            num_outputs = len(worker.state.outputs)
            try:
                worker.step()
            # a step that raises (a divergence in raise mode, Ctrl-C) may have released requests
            # already
            finally:
                if on_release is not None:
                    _report_releases(
                        worker, uuids, len(worker.state.outputs) - num_outputs, on_release
                    )
            recorder.record(worker)
            progress, before_step = _progress(worker), progress
            idle_steps = idle_steps + 1 if progress == before_step and worker.state.requests else 0
            if check_integrity:
                worker.check_integrity()
            if on_step is not None:
                on_step(sum(u in worker.state.outputs for u in uuids), len(uuids))
    # a stall, a divergence in raise mode, Ctrl-C: the log still gets the summary
    except BaseException as error:
        if worker.kv_compare is not None:
            with contextlib.suppress(Exception):  # the run's own error is the one to report
                worker.kv_compare.end_run(
                    stopped_by=exception_text(error), timeline=recorder.timeline()
                )
        raise
    wall = time.perf_counter() - started
    timeline = recorder.timeline()
    compare_summary = None
    if worker.kv_compare is not None:
        compare_summary = worker.kv_compare.end_run(timeline=timeline)
    after = worker.state.stats
    delta = WorkerStats(
        **{f.name: getattr(after, f.name) - getattr(before, f.name) for f in fields(WorkerStats)}
    )
    delta.peak_gpu_pages, delta.peak_host_pages = after.peak_gpu_pages, after.peak_host_pages
    return RunResult(
        workload=workload.name,
        outputs={u: worker.state.outputs[u] for u in uuids},
        num_steps=worker.state.step - start_step,
        wall_s=wall,
        stats=delta,
        leaked_gpu_pages=worker.gpu_kv.num_pages - worker.gpu_kv.free_pages(),
        leaked_host_pages=worker.host_kv.num_pages - worker.host_kv.free_pages(),
        loads_in_flight=len(
            [r for r in worker.state.requests.values() if r.load_handle is not None]
        ),
        live_requests=len(worker.state.requests),
        timeline=timeline,
        compare_summary=compare_summary,
    )
