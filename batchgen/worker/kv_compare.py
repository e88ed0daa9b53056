"""Compare mode for the KV ops: the binding between the worker and ``compare``.

Per compared op (``compare.ShadowExecutor`` fixes the order)::

    context       the op's request (snapshot and the columns the op reads): taken
                  from the side running the plan path, which builds it anyway
    shadow        fork the worker's state copy-on-write and overlay both pools
                  (bookkeeping only: no tensors; the forked host pool records the
                  copies it would issue), run the shadow path on the fork,
                  canonicalise its counters and keep its free page counts (the
                  rest waits for the authoritative step)
    authoritative run the authoritative path on the worker, its pools journaling and
                  its state recording the requests it writes; canonicalise both
                  sides' journals and copy lists (once, shared, when equal); of the
                  requests either side wrote, canonicalise those whose post-states
                  differ, from each side, into both forms
    compare       canonical forms: differing requests, new outputs, pending appends,
                  counters, each pool's allocator diff, the ordered copy ops

When neither side wrote anything (no request, pending append, pool page or copy:
most evict and migrate calls), both forms are only counters and result: every
other part equals the pre-state on both sides, so the verdict and field paths are
the same.

A request neither side wrote is the same object in both post-states, and one
written to the same values has equal canonical entries: leaving them out gives
the same verdict and field paths as canonicalising the whole scope (what
``replay`` does). Cost: a shallow copy of the request dict (C, a few ns per live
request), then what the op wrote: a copy of each request on its first write on
either side, the pool journals and copy lists, canonical forms of the requests
that differ. Both paths' own reads (evict walks every RUNNING request) are theirs.
Ops the executor does not sample run the authoritative path alone. Divergences go
to a JSON Lines log with what ``replay`` and ``minimize`` need (the op request, the
op's full pre-state rebuilt from what the worker wrote, the engine config and fault
SPEC); each run ends with a summary record.
"""

from __future__ import annotations

import time
import uuid as uuid_lib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from compare import DivergenceRecord, JsonlSink, Keyed, RunSummary, ShadowExecutor
from batchgen.worker.kv_apply import PlanKvPath
from batchgen.worker.kv_forms import (
    add_requests, canonical_copies, canonical_events, canonical_kv, canonical_pools, canonical_stats, classify,
    detach_fork, differing_requests, exception_kind, fork_target, pre_state,
)
from batchgen.worker.kv_gate import KvGateConfig, build_kv_path, kv_path_class
from batchgen.worker.kv_plans import to_jsonable
from batchgen.worker.kv_target import KvTarget


def _complete(canonical: dict, target: KvTarget, gpu_events: list, host_events: list, copies: list,
              uuids: Sequence[str] = ()) -> dict:
    """Fill in a canonical form begun without its journals, copies and requests. Mutates and returns it."""
    canonical["pools"].update(gpu=gpu_events, host=host_events)
    canonical["copies"] = copies
    add_requests(canonical["requests"], canonical["outputs"], target, uuids)
    return canonical


def _shared(mine: list, theirs: list, canonicalise: Callable[[list], list]) -> tuple[list, list]:
    """Both sides' canonical lists; one list, shared, when the raw ones are equal."""
    canonical = canonicalise(mine)
    return canonical, canonical if theirs == mine else canonicalise(theirs)


class _RecordingPlanKvPath(PlanKvPath):
    """The plan path, keeping the last op request it built: compare mode's replay context, so
    that the op's snapshot is built once, not twice."""

    last_request = None

    def poll_request(self, observed):
        self.last_request = super().poll_request(observed)
        return self.last_request

    def release_request(self, uuids):
        self.last_request = super().release_request(uuids)
        return self.last_request

    def eviction_request(self):
        self.last_request = super().eviction_request()
        return self.last_request

    def migration_request(self):
        self.last_request = super().migration_request()
        return self.last_request

    def alloc_request(self, batch):
        self.last_request = super().alloc_request(batch)
        return self.last_request


@dataclass(frozen=True, slots=True)
class _ShadowRun:
    """What the authoritative step of an op needs from its shadow step."""

    fork: KvTarget  # the shadow's post-state, its pools' journals and copies included
    canonical: dict  # the shadow's canonical form: counters and result (quiet), or with requests, outputs,
    # pools and copies still to be filled in
    free_pages: tuple[int, int]  # the fork's free GPU and host pages after the op (readable only until then)
    quiet: bool  # the shadow wrote nothing: no request, pending append, pool page or copy


def _wrote_nothing(target: KvTarget, written, dropped) -> bool:
    """Whether an op that wrote ``written`` and dropped ``dropped`` on ``target`` changed no request, pending
    append, pool page or copy (its pools journal and its host pool records copies). Pure."""
    return not (written or dropped or target.gpu_kv.journal or target.host_kv.journal or target.host_kv.copies)


def _quiet_form(target: KvTarget, result) -> dict:
    """The canonical form of an op that wrote nothing: every other part equals the pre-state's, on both sides."""
    return {"stats": canonical_stats(target), "result": result}


def _full_form(canonical: dict, free_pages: tuple[int, int]) -> dict:
    """Turn a quiet form into a full one still to be completed (``_complete``). Mutates and returns it."""
    canonical.update(requests=Keyed(), outputs=Keyed(),
                     pools={"gpu": [], "host": [], "num_free_gpu": free_pages[0], "num_free_host": free_pages[1]})
    return canonical


class KvCompare:
    """The KV ops with an authoritative path on the worker and a shadow path on forks.

    Same interface as the paths (poll, release, evict, migrate, allocate).
    ``shadow_path`` defaults to the other path; passing the authoritative one
    gives the A/A noise check.
    """

    def __init__(self, target: KvTarget, gate: KvGateConfig, *, shadow_path: str | None = None,
                 sink: JsonlSink | None = None, seed: int = 0, faults: str | None = None):
        """``faults``: the fault SPEC the worker runs under, recorded with each divergence (for minimize)."""
        self.target = target
        self.faults = faults
        self.gate = gate
        self.authoritative_path = gate.path
        self.shadow_path = shadow_path or gate.shadow_path
        if gate.path == "plan":
            self.authoritative = _RecordingPlanKvPath(target)
        else:
            self.authoritative = build_kv_path(gate.path, target)
        self._requests = PlanKvPath(target)  # builds the replay context when neither side's plan path does
        if self.shadow_path == "plan":
            self._new_shadow_path = partial(_RecordingPlanKvPath, geometry=self._requests.geometry)
        else:
            self._new_shadow_path = kv_path_class(self.shadow_path)  # resolved once: no import per op
        self._shadow_request = None  # the op request the shadow plan path built on the fork
        self.sink = sink if sink is not None else JsonlSink(gate.compare_log)
        self.seed = seed
        self.run_id = self.workload = self.workload_source = ""
        self.scale = 1.0
        self._shadow_run: _ShadowRun | None = None  # handed from an op's shadow step to its authoritative step
        self._written: dict = {}  # what the last authoritative step wrote: uuid -> the request before it
        self.executor = self.begin_run("unnamed", seed=seed)

    # ---- runs ----------------------------------------------------------------------------
    def begin_run(self, workload: str, *, seed: int, source: str | None = None, scale: float = 1.0) -> ShadowExecutor:
        """Start counting a new run (one workload). Mutates self."""
        self.run_id = f"{workload}-{uuid_lib.uuid4().hex[:8]}"
        self.workload, self.seed = workload, seed
        self.workload_source, self.scale = source or workload, scale
        self.executor = ShadowExecutor(
            mode=self.gate.compare, sample=self.gate.compare_sample, seed=seed, ops=self.gate.compare_ops,
            classify=classify, exception_kind=exception_kind, on_divergence=self._record,
        )
        return self.executor

    def end_run(self) -> RunSummary:
        """Write and return the run's summary record."""
        summary = RunSummary.from_stats(self.executor.stats(), run_id=self.run_id, workload=self.workload,
                                        seed=self.seed, authoritative=self.authoritative_path, shadow=self.shadow_path)
        self.sink.write(summary)
        return summary

    # ---- the KvPath interface ---------------------------------------------------------------
    def poll(self, observed: Mapping[str, str | None]) -> None:
        self._compare("poll", lambda path: path.poll(observed), lambda: self._requests.poll_request(observed))

    def release(self, uuids: Sequence[str]) -> None:
        self._compare("release", lambda path: path.release(uuids), lambda: self._requests.release_request(uuids))

    def evict(self) -> None:
        self._compare("evict", lambda path: path.evict(), self._requests.eviction_request)

    def migrate(self) -> None:
        self._compare("migrate", lambda path: path.migrate(), self._requests.migration_request)

    def allocate(self, batch: Sequence[str]) -> list[str]:
        return self._compare("alloc", lambda path: path.allocate(batch), lambda: self._requests.alloc_request(batch))

    # ---- internals -------------------------------------------------------------------------
    def _compare(self, op: str, call: Callable, request: Callable):
        step = self.target.state.step
        if not self.executor.should_compare(op, step):
            return call(self.authoritative)
        self._shadow_run = self._shadow_request = None
        self._written = {}
        if self.authoritative_path == "plan":
            self.authoritative.last_request = None
        return self.executor.run(
            op, step,
            context=lambda: self._context(op, request),
            shadow=lambda: self._run_shadow(call),
            authoritative=lambda: self._run_authoritative(call),
            shadow_path=self.shadow_path, authoritative_path=self.authoritative_path,
        )

    def _run_shadow(self, call: Callable) -> dict:
        """The shadow path on a fork. Its canonical form's requests, outputs, pool journals and copies
        are left for the authoritative step to fill in, once both post-states exist. Sets ``_shadow_run``."""
        fork = fork_target(self.target)
        path = self._new_shadow_path(fork)
        try:
            result = call(path)
        finally:
            self._shadow_request = getattr(path, "last_request", None)
        # The fork's pools can be read only until the authoritative path changes the worker's.
        free_pages = (fork.gpu_kv.free_pages(), fork.host_kv.free_pages())
        quiet = _wrote_nothing(fork, fork.state.written, fork.dropped)
        canonical = _quiet_form(fork, result) if quiet else _full_form(_quiet_form(fork, result), free_pages)
        self._shadow_run = _ShadowRun(fork, canonical, free_pages, quiet)
        return canonical

    def _run_authoritative(self, call: Callable):
        """The authoritative path on the worker; completes both canonical forms. Journals the pools and
        the requests written (``WorkerState.written``) meanwhile.

        Only requests whose post-states differ are canonicalised (on both sides); journals and copy
        lists equal on both sides are canonicalised once and shared.
        """
        shadow, self._shadow_run = self._shadow_run, None
        state, gpu, host = self.target.state, self.target.gpu_kv, self.target.host_kv
        gpu.pages.journal, host.pages.journal, host.copies = [], [], []
        written = self._written = state.written = {}
        dropped = self.target.dropped = set()
        try:
            try:
                result = call(self.authoritative)
            except Exception:
                if shadow is not None:  # the record still carries the shadow's journals (replay reads them)
                    fork = shadow.fork
                    if shadow.quiet:
                        _full_form(shadow.canonical, shadow.free_pages)
                    _complete(shadow.canonical, fork, canonical_events(fork.gpu_kv.journal),
                              canonical_events(fork.host_kv.journal), canonical_copies(fork.host_kv.copies))
                raise
            if shadow is None:  # the shadow raised: exceptions are compared, this form is only logged
                return result, canonical_kv(self.target, list(written), result, gpu.journal, host.journal, host.copies)
            if shadow.quiet:
                if _wrote_nothing(self.target, written, dropped):  # neither side changed anything but counters
                    return result, _quiet_form(self.target, result)
                _full_form(shadow.canonical, shadow.free_pages)
            fork = shadow.fork
            gpu_events, fork_gpu_events = _shared(gpu.journal, fork.gpu_kv.journal, canonical_events)
            host_events, fork_host_events = _shared(host.journal, fork.host_kv.journal, canonical_events)
            copies, fork_copies = _shared(host.copies, fork.host_kv.copies, canonical_copies)
            detach_fork(fork, written, dropped)
            differing = differing_requests(fork, self.target, written, dropped)
            _complete(shadow.canonical, fork, fork_gpu_events, fork_host_events, fork_copies, differing)
            mine = {"requests": Keyed(), "outputs": Keyed(), "stats": canonical_stats(self.target),
                    "pools": canonical_pools(self.target, [], []), "result": result}
            return result, _complete(mine, self.target, gpu_events, host_events, copies, differing)
        finally:
            gpu.pages.journal = host.pages.journal = host.copies = state.written = self.target.dropped = None

    def _context(self, op: str, request: Callable) -> tuple:
        """(op, request or None), before either path runs.

        The op request is taken, when a divergence is recorded, from a plan path that builds it
        anyway: the authoritative one, or else the shadow one, whose fork holds the worker's
        pre-state. With no plan side (A/A legacy) it is built now.
        """
        if "plan" in (self.authoritative_path, self.shadow_path):
            return op, None
        return op, request()

    def _replay_request(self, context: tuple):
        """The op request of a recorded divergence (None if its plan path raised before building it)."""
        op, request = context
        if request is not None:
            return request
        if self.authoritative_path == "plan":
            return self.authoritative.last_request
        return self._shadow_request

    def _record(self, comparison, context) -> None:
        op, request = context[0], self._replay_request(context)
        replay = {
            "op": op,
            "request_type": type(request).__name__,
            "request": to_jsonable(request),
            "pre_state": None if request is None else to_jsonable(pre_state(op, request, self.target, self._written)),
            "pools": {name: (seen.value or {}).get("pools") for name, seen in
                      (("authoritative", comparison.authoritative), ("shadow", comparison.shadow))},
            "kv_path": self.authoritative_path,
            "shadow_path": self.shadow_path,
            "workload_source": self.workload_source,
            "scale": self.scale,
            "engine": self.target.engine_config.model_dump(mode="json"),  # overrides (--kv-load-*) included
            "faults": self.faults,
        }
        record = DivergenceRecord.from_comparison(comparison, run_id=self.run_id, workload=self.workload,
                                                  seed=self.seed, replay=replay, created_at=time.time())
        self.sink.write(record)
