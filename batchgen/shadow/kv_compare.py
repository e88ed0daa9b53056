"""Compare mode for the KV ops: the binding between the worker and ``compare``.

Per compared op (``compare.ShadowExecutor`` fixes the order)::

    context       the op's request (snapshot and the columns the op reads): taken
                  from the side running the plan path, which builds it anyway
    fork          fork the worker's state copy-on-write and overlay both pools
                  (bookkeeping only: no tensors; the forked host pool records the
                  copies it would issue)
    shadow        run the shadow path on the fork; keep its free page counts
    authoritative run the authoritative path on the worker, its pools journaling and
                  its state recording the requests it writes
    canonicalize  both sides' counters, journals and copy lists (once, shared, when
                  equal); of the requests either side wrote, those whose post-states
                  differ, from each side, into both forms
    compare       canonical forms: differing requests, new outputs, pending appends,
                  counters, each pool's allocator diff, the ordered copy ops

Only the paths' own exceptions are observations: a failure in forking or
canonicalising is the harness's (counted, warned, never a divergence, never raised
into the worker).

When neither side wrote anything (no request, pending append, pool page or copy:
most evict and migrate calls), both forms are only counters and result: every
other part equals the pre-state on both sides, so the verdict and field paths are
the same.

A request neither side wrote is the same object in both post-states, and one
written to the same values has equal canonical entries: leaving them out gives
the same verdict and field paths as canonicalising the whole scope (what
``replay`` does). Cost: what the op wrote: on the fork's first write, a shallow
copy of the request dict (C, a few ns per live request); a copy of each request on
its first write on either side, the pool journals and copy lists, canonical forms of the requests
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
from operator import methodcaller

from batchgen.kv.gate import KvGateConfig, build_kv_path, kv_path_class
from batchgen.kv.plan_path import PlanKvPath
from batchgen.kv.plans import to_jsonable
from batchgen.kv.target import KvTarget
from batchgen.shadow.forms import (
    canonical_copies,
    canonical_events,
    canonical_form,
    canonical_kv,
    canonical_result,
    canonical_stats,
    classify,
    detach_fork,
    differing_requests,
    exception_kind,
    fork_target,
    pre_state,
)
from compare import DivergenceRecord, JsonlSink, Observation, RunSummary, ShadowExecutor

_EVICT, _MIGRATE = methodcaller("evict"), methodcaller("migrate")  # the op on a path, called in C
_NO_OP = ("", None, None)


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
    """What the shadow step of an op leaves for canonicalisation."""

    fork: KvTarget  # the shadow's post-state, its pools' journals and copies included
    result: object  # what the shadow path's op returned
    # the fork's free GPU and host pages after the op (readable only until the
    free_pages: tuple[int, int]
    # authoritative path changes the worker's pools)


def wrote_nothing(target: KvTarget, written, dropped) -> bool:
    """Whether an op that wrote ``written`` and dropped ``dropped`` on ``target`` changed no
    request, pending append, pool page or copy (its pools journal and its host pool records copies).
    Pure."""
    host = target.host_kv
    return not (
        written or dropped or target.gpu_kv.pages.journal or host.pages.journal or host.copies
    )


def _quiet_form(target: KvTarget, result) -> dict:
    """The canonical form of an op that wrote nothing: every other part equals the pre-state's, on
    both sides."""
    return {"stats": canonical_stats(target), "result": canonical_result(result)}


class KvCompare:
    """The KV ops with an authoritative path on the worker and a shadow path on forks.

    Same interface as the paths (poll, release, evict, migrate, allocate).
    ``shadow_path`` defaults to the other path; passing the authoritative one
    gives the A/A noise check.
    """

    def __init__(
        self,
        target: KvTarget,
        gate: KvGateConfig,
        *,
        shadow_path: str | None = None,
        faults: str | None = None,
    ):
        """``faults``: the fault SPEC the worker runs under, recorded with each divergence (for
        minimize)."""
        self.target = target
        self.faults = faults
        self.gate = gate
        self.authoritative_path = gate.path
        self.shadow_path = shadow_path or gate.shadow_path
        if gate.path == "plan":
            self.authoritative = _RecordingPlanKvPath(target)
        else:
            self.authoritative = build_kv_path(gate.path, target)
        # builds the replay context when neither side's plan path does
        self._requests = PlanKvPath(target)
        if self.shadow_path == "plan":
            self._new_shadow_path = partial(_RecordingPlanKvPath, geometry=self._requests.geometry)
        else:
            # resolved once: no import per op
            self._new_shadow_path = kv_path_class(self.shadow_path)
        self._shadow_request = None  # the op request the shadow plan path built on the fork
        self.sink = JsonlSink(gate.compare_log)
        self.seed = 0
        self.run_id = self.workload = self.workload_source = ""
        self.scale = 1.0
        # what the last authoritative step wrote: uuid -> the request before it
        self._written: dict = {}
        # while an op is compared: (name, the op on a path, its request builder)
        self._op: tuple = _NO_OP
        self._summary: RunSummary | None = None  # the current run's summary, once it ended
        self.executor = self.begin_run("unnamed", seed=0)

    # ---- runs ----------------------------------------------------------------------------
    def begin_run(
        self,
        workload: str,
        *,
        seed: int,
        source: str | None = None,
        scale: float = 1.0,
        run_id: str | None = None,
    ) -> ShadowExecutor:
        """Start counting a new run (one workload). ``run_id`` names it in every record (default:
        ``<workload>-<random hex>``; a sweep derives it from the run's inputs, so that the same
        matrix logs the same ids). Mutates self."""
        self.run_id = run_id or f"{workload}-{uuid_lib.uuid4().hex[:8]}"
        self.workload, self.seed = workload, seed
        self.workload_source, self.scale = source or workload, scale
        self._summary = None
        self.executor = ShadowExecutor(
            mode=self.gate.compare,
            sample=self.gate.compare_sample,
            seed=seed,
            ops=self.gate.compare_ops,
            classify=classify,
            exception_kind=exception_kind,
            on_divergence=self._record,
        )
        return self.executor

    def end_run(self, *, stopped_by: str | None = None) -> RunSummary:
        """Write and return the run's summary record, once: a later call returns the same summary.
        ``stopped_by``: why the run stopped before its work was done (None: it was done)."""
        if self._summary is None:
            self._summary = RunSummary.from_stats(
                self.executor.stats(),
                run_id=self.run_id,
                workload=self.workload,
                seed=self.seed,
                authoritative=self.authoritative_path,
                shadow=self.shadow_path,
                stopped_by=stopped_by,
            )
            self.sink.write(self._summary)
        return self._summary

    # ---- the KvPath interface ---------------------------------------------------------------
    def poll(self, observed: Mapping[str, str | None]) -> None:
        self._compare(
            "poll", methodcaller("poll", observed), partial(self._requests.poll_request, observed)
        )

    def release(self, uuids: Sequence[str]) -> None:
        self._compare(
            "release",
            methodcaller("release", uuids),
            partial(self._requests.release_request, uuids),
        )

    def evict(self) -> None:
        self._compare("evict", _EVICT, self._requests.eviction_request)

    def migrate(self) -> None:
        self._compare("migrate", _MIGRATE, self._requests.migration_request)

    def allocate(self, batch: Sequence[str]) -> list[str]:
        return self._compare(
            "alloc", methodcaller("allocate", batch), partial(self._requests.alloc_request, batch)
        )

    # ---- internals -------------------------------------------------------------------------
    def _compare(self, op: str, call: Callable, request: Callable):
        """Run ``call`` (the op on a path) on the authoritative path, and, when the executor samples
        this step, on the shadow path on a fork, and compare. ``request`` builds the op request (the
        replay context) when no plan path builds it. Mutates what the op mutates, and this op's
        ``_op``."""
        step = self.target.state.step
        if not self.executor.should_compare(op, step):
            return call(self.authoritative)
        self._op = (op, call, request)
        self._shadow_request = None
        self._written = {}
        if self.authoritative_path == "plan":
            self.authoritative.last_request = None
        try:
            return self.executor.run_both(
                op,
                step,
                context=self._context,
                fork=self._fork,
                shadow=self._run_shadow,
                authoritative=self._run_authoritative,
                canonicalize=self._canonicalize,
                shadow_path=self.shadow_path,
                authoritative_path=self.authoritative_path,
            )
        finally:  # journaling ends with the op, whatever failed
            self.target.record_op(False)
            self._op = _NO_OP

    def _fork(self) -> tuple[KvTarget, object]:
        """A copy-on-write fork of the worker's target, and the shadow path on it."""
        fork = fork_target(self.target)
        return fork, self._new_shadow_path(fork)

    def _run_shadow(self, forked: tuple[KvTarget, object]) -> _ShadowRun:
        """The shadow path's op on its fork; what the canonical forms need of it."""
        fork, path = forked
        try:
            result = self._op[1](path)
        finally:
            self._shadow_request = getattr(path, "last_request", None)
        # The fork's pools can be read only until the authoritative path changes the worker's.
        return _ShadowRun(fork, result, (fork.gpu_kv.free_pages(), fork.host_kv.free_pages()))

    def _run_authoritative(self):
        """The authoritative path on the worker, its pools journaling and its state recording the
        requests it writes (``WorkerState.written``) and the pending appends it drops, until
        ``_compare`` ends."""
        self.target.record_op(True)
        self._written = self.target.state.written
        return self._op[1](self.authoritative)

    def _canonicalize(
        self, seen: Observation, shadow_seen: Observation
    ) -> tuple[dict | None, dict | None]:
        """Both canonical forms, once both post-states exist (compare mode's harness, not either
        path).

        Only requests whose post-states differ are canonicalised (on both sides); journals and copy
        lists equal on both sides are canonicalised once and shared. When neither side wrote
        anything both forms are only counters and result. Pure, but for the fork's request view
        (``detach_fork``)."""
        target, written, dropped = self.target, self._written, self.target.dropped
        gpu, host = target.gpu_kv, target.host_kv
        shadow: _ShadowRun | None = shadow_seen.value
        if seen.raised:  # the record still carries the shadow's form (replay reads its journals)
            if shadow is None:
                return None, None
            fork = shadow.fork
            return None, canonical_form(
                fork,
                shadow.result,
                shadow.free_pages,
                canonical_events(fork.gpu_kv.journal),
                canonical_events(fork.host_kv.journal),
                canonical_copies(fork.host_kv.copies),
            )
        if shadow is None:  # the shadow raised: exceptions are compared, this form is only logged
            return (
                canonical_kv(
                    target, list(written), seen.value, gpu.journal, host.journal, host.copies
                ),
                None,
            )
        fork, result = shadow.fork, seen.value
        if wrote_nothing(fork, fork.state.written, fork.dropped) and wrote_nothing(
            target, written, dropped
        ):
            return _quiet_form(target, result), _quiet_form(fork, shadow.result)
        gpu_events, fork_gpu_events = _shared(gpu.journal, fork.gpu_kv.journal, canonical_events)
        host_events, fork_host_events = _shared(
            host.journal, fork.host_kv.journal, canonical_events
        )
        copies, fork_copies = _shared(host.copies, fork.host_kv.copies, canonical_copies)
        detach_fork(fork, written, dropped)
        differing = differing_requests(fork, target, written, dropped)
        theirs = canonical_form(
            fork,
            shadow.result,
            shadow.free_pages,
            fork_gpu_events,
            fork_host_events,
            fork_copies,
            differing,
        )
        mine = canonical_form(
            target,
            result,
            (gpu.free_pages(), host.free_pages()),
            gpu_events,
            host_events,
            copies,
            differing,
        )
        return mine, theirs

    def _context(self) -> tuple:
        """(op, request or None), before either path runs.

        The op request is taken, when a divergence is recorded, from a plan path that builds it
        anyway: the authoritative one, or else the shadow one, whose fork holds the worker's
        pre-state. With no plan side (A/A legacy) it is built now.
        """
        op, _, request = self._op
        if "plan" in (self.authoritative_path, self.shadow_path):
            return op, None
        return op, request()

    def _replay_request(self, context: tuple):
        """The op request of a recorded divergence (None if its plan path raised before building
        it)."""
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
            "pre_state": (
                None
                if request is None
                else to_jsonable(pre_state(op, request, self.target, self._written))
            ),
            "pools": {
                name: (seen.value or {}).get("pools")
                for name, seen in (
                    ("authoritative", comparison.authoritative),
                    ("shadow", comparison.shadow),
                )
            },
            "kv_path": self.authoritative_path,
            "shadow_path": self.shadow_path,
            "workload_source": self.workload_source,
            "scale": self.scale,
            # built-in traces draw their token ids (and so their
            "vocab_size": self.target.model_config.vocab_size,
            # lengths, through the generator) from it
            # overrides (--kv-load-*) included
            "engine": self.target.engine_config.model_dump(mode="json"),
            "faults": self.faults,
        }
        record = DivergenceRecord.from_comparison(
            comparison,
            run_id=self.run_id,
            workload=self.workload,
            seed=self.seed,
            replay=replay,
            created_at=time.time(),
        )
        self.sink.write(record)
