"""The scale check's driver and its measurements: a worker kept at a fixed number of live requests,
timed per step.

``ScaleRun`` runs the worker one step at a time and refills each released slot,
as a client would; ``PhaseTimer`` splits each step's time into the worker's KV
ops, its other methods and the cyclic collector; ``StepSeries`` keeps the
figures of every step; ``resident_bytes`` reads the resident set.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import time
from dataclasses import dataclass, field, replace

from scale_workload import num_anchors, scale_model

from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload
from batchgen.kv.gate import KvGateConfig
from batchgen.model.null_model import NullModel


def resident_bytes() -> int:
    """This process's resident set now (Linux ``/proc/self/statm``), after a full collection."""
    gc.collect()
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# phase of a step -> the worker method it times (KV ops first: their sum is the KV-op time)
KV_PHASES = {
    "poll": "_kv_poll",
    "release": "_kv_release",
    "evict": "_kv_evict",
    "migrate": "_kv_migrate",
    "alloc": "_kv_allocate",
}
WORKER_PHASES = {
    "observe_loads": "_observe_loads",
    "flush_appends": "_flush_pending_kv_appends",
    "schedule": "_schedule",
    "forward_sample": "_forward_and_sample",
    "record_peaks": "_record_peaks",
}


class PhaseTimer:
    """Seconds per phase of the worker's steps: its KV ops, its other methods, the cyclic collector.

    ``attach`` shadows the timed methods with instance attributes (the worker's
    class is untouched); collections are counted only inside ``measuring()``,
    which holds a ``gc`` callback for its duration.
    """

    def __init__(self):
        self.seconds = dict.fromkeys([*KV_PHASES, *WORKER_PHASES, "gc"], 0.0)
        self._gc_started = 0.0

    def attach(self, worker: Worker) -> None:
        """Mutates ``worker``: its timed methods become timing wrappers."""
        for phase, name in {**KV_PHASES, **WORKER_PHASES}.items():
            setattr(worker, name, self._timed(phase, getattr(worker, name)))

    @contextlib.contextmanager
    def measuring(self):
        gc.callbacks.append(self._on_gc)
        try:
            yield
        finally:
            gc.callbacks.remove(self._on_gc)

    def step_seconds(self) -> float:
        """Seconds in the timed methods (a collection inside one is part of it)."""
        return sum(s for phase, s in self.seconds.items() if phase != "gc")

    def kv_seconds(self) -> float:
        return sum(self.seconds[phase] for phase in KV_PHASES)

    def _timed(self, phase: str, call):
        def timed(*args):
            started = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.seconds[phase] += time.perf_counter() - started

        return timed

    def _on_gc(self, event: str, info: dict) -> None:
        if event == "start":
            self._gc_started = time.perf_counter()
        else:
            self.seconds["gc"] += time.perf_counter() - self._gc_started


@dataclass
class StepSeries:
    """Per-step figures of one run, in step order."""

    step_s: list[float] = field(default_factory=list)
    kv_s: list[float] = field(default_factory=list)
    client_s: list[float] = field(default_factory=list)  # collecting outputs and refilling slots
    num_served: list[int] = field(default_factory=list)
    gpu_pages_used: list[int] = field(default_factory=list)
    host_pages_used: list[int] = field(default_factory=list)
    rss_bytes: dict[int, int] = field(default_factory=dict)  # step -> resident set after gc


class ScaleRun:
    """A worker kept at ``len(workload.requests)`` live requests; ``step()`` runs one step.

    Keeps the workload's requests as ``Request`` templates (one tuple per distinct
    prompt), not the workload itself, so its lists do not inflate the resident set.

    Mutates its worker: refills each released request's slot with the next generation
    of that slot, a request drawn (seeded) from the workload, and removes the released
    output from ``worker.state.outputs`` (``drain_outputs=False`` keeps them all).
    """

    def __init__(self, workload: Workload, gate: KvGateConfig, *, drain_outputs: bool = True):
        # one tuple per distinct prompt (the anchors')
        prompts: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.templates = [
            replace(r, prompt_ids=prompts.setdefault(r.prompt_ids, r.prompt_ids))
            for r in (w.to_request() for w in workload.requests)
        ]
        self.num_anchors = num_anchors(len(self.templates))
        self.worker = Worker(
            NullModel(scale_model(workload)),
            cache_config=workload.cache,
            engine_config=workload.engine,
            kv_gate=gate,
            kv_storage=False,
        )
        self.timer = PhaseTimer()
        self.timer.attach(self.worker)
        self.drain_outputs = drain_outputs
        self.rng = random.Random(f"refill:{workload.seed}")
        self.generation = [0] * len(self.templates)
        self.num_finished = 0
        self.num_kept = 0  # outputs left in the worker (drain_outputs=False)
        self.series = StepSeries()
        if self.worker.kv_compare is not None:
            self.worker.kv_compare.begin_run(workload.name, seed=workload.seed)
        for request in self.templates:
            self.worker.add_request(request)

    def step(self) -> None:
        """One worker step, then the client's turn: collect outputs, refill their slots."""
        worker, series = self.worker, self.series
        kv_before, tokens_before = self.timer.kv_seconds(), worker.state.stats.tokens_generated
        with self.timer.measuring():
            started = time.perf_counter()
            worker.step()
            series.step_s.append(time.perf_counter() - started)
        series.kv_s.append(self.timer.kv_seconds() - kv_before)
        series.num_served.append(worker.state.stats.tokens_generated - tokens_before)
        series.gpu_pages_used.append(worker.gpu_kv.num_pages - worker.gpu_kv.free_pages())
        series.host_pages_used.append(worker.host_kv.num_pages - worker.host_kv.free_pages())
        started = time.perf_counter()
        self._refill()
        series.client_s.append(time.perf_counter() - started)

    def _refill(self) -> None:
        released = list(self.worker.state.outputs)[self.num_kept :]  # outputs keep release order
        if self.drain_outputs:
            self.worker.take_outputs(released)
        for uuid in released:
            slot = self._slot(uuid)
            self.generation[slot] += 1
            if slot < self.num_anchors:  # only past ANCHOR_NEW_TOKENS steps
                template = self.templates[slot]
            else:
                template = self.templates[self.rng.randrange(self.num_anchors, len(self.templates))]
            self.worker.add_request(replace(template, uuid=f"s{slot}.g{self.generation[slot]}"))
        self.num_finished += len(released)
        if not self.drain_outputs:
            self.num_kept += len(released)

    @staticmethod
    def _slot(uuid: str) -> int:
        return int(uuid[1 : uuid.index(".")])
