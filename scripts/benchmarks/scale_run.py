"""The driver of ``bench.py scale`` (the scale check) and its measurements: a worker kept at a
fixed number of live requests, timed per step.

``ScaleRun`` runs the worker one step at a time and refills each released slot, as a client would;
``PhaseTimer`` splits each step's time into the worker's KV ops, scheduling, its other methods and
the cyclic collector (wall time, through ``ab_timer``); ``StepSeries`` keeps the figures of every
step; ``resident_bytes`` reads the resident set.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import time
from dataclasses import dataclass, field, replace

import batchgen.engine.worker as worker_module
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload
from batchgen.kv.gate import KV_OPS, KvGateConfig
from batchgen.model.null_model import NullModel
from batchgen.shadow.wiring import gated_worker

from .ab_timer import CLOCKS, time_kv_ops, timed_call
from .scale_workload import num_anchors, scale_model


def resident_bytes() -> int:
    """This process's resident set now (Linux ``/proc/self/statm``), after a full collection."""
    gc.collect()
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# the functions the worker module calls in a step, timed while measuring
MODULE_PHASES = ("schedule", "observe_loads")
# the worker's other parts of a step: phase -> Worker method
WORKER_PHASES = {
    "flush_appends": "_flush_pending_kv_appends",
    "forward_sample": "_forward_and_sample",
    "record_peaks": "_record_peaks",
}
PHASES = [*KV_OPS, *MODULE_PHASES, *WORKER_PHASES]  # the KV ops' sum is the KV-op time
WALL = CLOCKS["wall"]


class PhaseTimer:
    """Seconds per phase of the worker's steps: its KV ops, scheduling, its other methods, the
    cyclic collector.

    ``attach`` shadows the timed methods of the worker and its KV ops (``ab_timer.time_kv_ops``)
    with instance attributes (their classes are untouched). ``measuring()`` times the functions
    of ``MODULE_PHASES`` the worker module calls (replaced for its duration) and counts collections
    (a ``gc`` callback for its duration).
    """

    def __init__(self):
        self.seconds = dict.fromkeys([*PHASES, "gc"], 0.0)
        self._gc_started = 0.0

    def attach(self, worker: Worker) -> None:
        """Mutates ``worker`` and its KV path object: their timed methods become timing wrappers."""
        time_kv_ops(worker, self._add, WALL)
        for phase, name in WORKER_PHASES.items():
            setattr(worker, name, timed_call(phase, getattr(worker, name), self._add, WALL))

    @contextlib.contextmanager
    def measuring(self):
        """Mutates ``batchgen.engine.worker`` while open: its ``MODULE_PHASES`` are timed."""
        originals = {name: getattr(worker_module, name) for name in MODULE_PHASES}
        for name, function in originals.items():
            setattr(worker_module, name, timed_call(name, function, self._add, WALL))
        gc.callbacks.append(self._on_gc)
        try:
            yield
        finally:
            gc.callbacks.remove(self._on_gc)
            for name, function in originals.items():
                setattr(worker_module, name, function)

    def step_seconds(self) -> float:
        """Seconds in the timed phases (a collection inside one is part of it)."""
        return sum(s for phase, s in self.seconds.items() if phase != "gc")

    def kv_seconds(self) -> float:
        return sum(self.seconds[phase] for phase in KV_OPS)

    def _add(self, phase: str, ns: int) -> None:
        self.seconds[phase] += ns / 1e9

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

    Mutates its worker: removes each released output from ``worker.state.outputs`` (as a
    client collecting results would) and refills the request's slot with the next generation
    of that slot, a request drawn (seeded) from the workload.
    """

    def __init__(self, workload: Workload, gate: KvGateConfig):
        # one tuple per distinct prompt (the anchors')
        prompts: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.templates = [
            replace(r, prompt_ids=prompts.setdefault(r.prompt_ids, r.prompt_ids))
            for r in (w.to_request() for w in workload.requests)
        ]
        self.num_anchors = num_anchors(len(self.templates))
        self.worker = gated_worker(
            NullModel(scale_model(workload)),
            cache_config=workload.cache,
            engine_config=workload.engine,
            kv_gate=gate,
            kv_storage=False,
        )
        self.timer = PhaseTimer()
        self.timer.attach(self.worker)
        self.rng = random.Random(f"refill:{workload.seed}")
        self.generation = [0] * len(self.templates)
        self.num_finished = 0
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
        released = self.worker.take_outputs()  # in release order
        for uuid in released:
            slot = self._slot(uuid)
            self.generation[slot] += 1
            if slot < self.num_anchors:  # only past ANCHOR_NEW_TOKENS steps
                template = self.templates[slot]
            else:
                template = self.templates[self.rng.randrange(self.num_anchors, len(self.templates))]
            self.worker.add_request(replace(template, uuid=f"s{slot}.g{self.generation[slot]}"))
        self.num_finished += len(released)

    @staticmethod
    def _slot(uuid: str) -> int:
        return int(uuid[1 : uuid.index(".")])
