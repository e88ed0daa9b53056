"""Compare mode for the KV ops: the binding between the worker and ``compare``.

Per compared op (``compare.ShadowExecutor`` fixes the order)::

    context       the op being compared; with no plan path on either side (A/A legacy), its op
                  request and plan, built now from the pre-state
    fork          fork the worker's state copy-on-write and overlay both pools (bookkeeping
                  only: no tensors; the forked host pool records the copies it would issue)
    shadow        run the shadow path on the fork; keep its free page counts
    authoritative run the authoritative path on the worker, through wrappers recording what it
                  writes (``recording``: the requests, pool events, copies, pending appends)
    canonicalize  both post-states into comparable forms (``forms.canonical_pair``: only what
                  either side wrote)
    compare       the forms; then, when both paths returned, the decision outcomes and the
                  interactions the op reached (``coverage.outcomes_of``, from the plan path's
                  request and plan; ``interactions.interactions_of``, with the run's history,
                  which the op then joins: ``history.RunHistory``)

Only the paths' own exceptions are observations: a failure in forking or canonicalizing is the
harness's (counted, warned, never a divergence, never raised into the worker). Each run (a
workload) is a ``compare.Experiment``: it samples the ops, logs divergences, with what
``replay`` and ``minimize`` need, and ends with a summary record, decision coverage included.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from batchgen.kv.gate import KV_BINDING, KvGateConfig, build_kv_path, kv_path_class
from batchgen.kv.known_bugs import demo_bug
from batchgen.kv.plan_path import OP_METHODS, PlanKvPath
from batchgen.kv.target import KvTarget
from batchgen.shadow.coverage import outcomes_of
from batchgen.shadow.fork import fork_target
from batchgen.shadow.forms import ShadowRun, canonical_pair, classify, exception_kind
from batchgen.shadow.history import RunHistory
from batchgen.shadow.interactions import interactions_of
from batchgen.shadow.recording import recorded, start, stop
from batchgen.shadow.replay_payload import op_payload, run_payload
from compare import Experiment, JsonlSink, Observation, RunSummary, Timeline


@dataclass(slots=True)
class ComparedOp:
    """The op being compared: the context the executor hands to its hooks. Mutated as it runs."""

    name: str
    args: tuple
    shadow: object = None  # the shadow path object, on its fork
    decision: tuple = (None, None)  # (op request, plan) built beforehand, when no side plans


class KvCompare:
    """The KV ops with an authoritative path on the worker and a shadow path on forks.

    Same interface as the paths (poll, release, evict, migrate, allocate). ``shadow_path``
    defaults to the other path; passing the authoritative one gives the A/A noise check.
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
        self.target, self.gate, self.faults = target, gate, faults
        self.authoritative_path = gate.path
        self.shadow_path = shadow_path or gate.shadow_path
        self.authoritative = build_kv_path(gate.path, target)  # for the ops not compared
        self.recorded = recorded(target)  # the worker's target, recording what a compared op writes
        self._recorded_path = build_kv_path(gate.path, self.recorded)
        self._planner = PlanKvPath(target)  # reads the pre-state when neither side plans
        self._shadow_class = kv_path_class(self.shadow_path)  # resolved once: no import per op
        self._demo_bug = demo_bug(gate.compare_demo_bug, self.shadow_path)  # planted per fork
        self.sink = JsonlSink(gate.compare_log)  # every run's log
        self._op: ComparedOp | None = None
        # the worker's page-content oracle (batchgen.engine.kv_verify), when on: runs as this one's
        self.verifier = None
        self.clock = time.perf_counter  # every harness time, the budget's too (tests fake it)
        self.on_record = None  # called with each record once it is logged (batchgen.metrics)
        self.begin_run("unnamed", seed=0)

    # ---- runs ------------------------------------------------------------------------------
    def begin_run(
        self,
        workload: str,
        *,
        seed: int,
        source: str | None = None,
        scale: float = 1.0,
        run_id: str | None = None,
    ) -> Experiment:
        """Start a new run (one workload). ``run_id`` names it in every record (default:
        ``<workload>-<random hex>``; a sweep derives it from the run's inputs, so that the same
        matrix logs the same ids). Mutates self."""
        self.payload = run_payload(
            self.target,
            paths=(self.authoritative_path, self.shadow_path),
            workload_source=source or workload,
            scale=scale,
            faults=self.faults,
            demo_bug=self._demo_bug.demo if self._demo_bug else None,
        )  # what every record of the run carries for minimize
        self.history = RunHistory()  # what the interaction classifier reads of the run so far
        self.experiment = Experiment.from_gate(
            KV_BINDING,
            self.gate,
            paths=(self.authoritative_path, self.shadow_path),
            log=self.sink,
            seed=seed,
            workload=workload,
            run_id=run_id,
            fork=self._fork,
            canonicalize=self._canonicalize,
            outcomes=self._outcomes,
            classify=classify,
            exception_kind=exception_kind,
            replay=self._replay,
            on_record=self._forward,
            clock=self.clock,
        )
        if self.verifier is not None:
            self.verifier.begin_run(self.run_id, workload=workload, seed=seed, replay=self.payload)
        return self.experiment

    def end_run(
        self, *, stopped_by: str | None = None, timeline: Timeline | None = None
    ) -> RunSummary:
        """Write and return the run's summary record, once: a later call returns the same summary.
        ``stopped_by``: why the run stopped before its work was done (None: it was done);
        ``timeline``: the run's per-step KV counters (``batchgen.engine.timeline``). Mutates self
        and the log."""
        data = self.verifier.summary() if self.verifier is not None else None
        return self.experiment.close(stopped_by=stopped_by, timeline=timeline, data=data)

    @property
    def run_id(self) -> str:
        return self.experiment.run_id

    @property
    def executor(self):
        """The current run's ``compare.ShadowExecutor``: its counters and sample rate."""
        return self.experiment.executor

    @property
    def governor(self):
        """The current run's budget and breaker (``compare.SampleGovernor``), when set."""
        return self.experiment.governor

    def note_abort_of_done(self, uuid: str) -> None:
        """An abort came for ``uuid`` after it was done: the run's history names it (the worker
        tells). Mutates ``history``."""
        self.history.note_abort_of_done(uuid)

    # ---- the KV path interface -------------------------------------------------------------
    def poll(self, observed: Mapping[str, str | None]) -> None:
        self._compare("poll", observed)

    def release(self, uuids: Sequence[str]) -> None:
        self._compare("release", uuids)

    def evict(self) -> None:
        self._compare("evict")

    def migrate(self) -> None:
        self._compare("migrate")

    def allocate(self, batch: Sequence[str]) -> list[str]:
        return self._compare("alloc", batch)

    # ---- one compared op -------------------------------------------------------------------
    def _compare(self, op: str, *args):
        """Run ``op`` on the authoritative path, and, when the run samples this step, on the
        shadow path on a fork, and compare. Mutates what the op mutates."""
        self._op = ComparedOp(op, args)
        try:
            return self.experiment.run(
                op,
                self.target.state.step,
                authoritative=self._run_authoritative,
                shadow=self._run_shadow,
                context=self._context,
            )
        finally:  # recording ends with the op, whatever failed
            if self.recorded.dropped is not None:
                stop(self.recorded)
            self._op = None

    def _context(self) -> ComparedOp:
        """The op; with neither side a plan path, its request and plan, planned now (the manager
        is pure) from the pre-state. Forgets what the authoritative path planned last."""
        op = self._op
        if isinstance(self._recorded_path, PlanKvPath):
            self._recorded_path.last_request = self._recorded_path.last_plan = None
        elif self.shadow_path != "plan":
            _, build_request, plan = OP_METHODS[op.name]
            request = getattr(self._planner, build_request)(*op.args)
            op.decision = (request, getattr(self._planner.manager, plan)(request))
        return op

    def _fork(self) -> tuple[KvTarget, object]:
        """A copy-on-write fork of the worker's target, and the shadow path on it."""
        fork = fork_target(self.target)
        if self._shadow_class is PlanKvPath:
            self._op.shadow = PlanKvPath(fork, self._planner.geometry)
        else:
            self._op.shadow = self._shadow_class(fork)
        if self._demo_bug is not None:
            self._demo_bug.plant(self._op.shadow)
        return fork, self._op.shadow

    def _run_shadow(self, forked: tuple[KvTarget, object]) -> ShadowRun:
        """The shadow path's op on its fork; what the canonical forms need of it."""
        fork, path = forked
        result = getattr(path, OP_METHODS[self._op.name][0])(*self._op.args)
        # The fork's pools can be read only until the authoritative path changes the worker's.
        return ShadowRun(fork, result, (fork.gpu_kv.free_pages(), fork.host_kv.free_pages()))

    def _run_authoritative(self):
        """The authoritative path's op on the worker; on a compared op (the shadow ran on a fork),
        through the wrappers, recording what it writes until ``_compare`` ends."""
        op = self._op
        if op.shadow is None:
            return getattr(self.authoritative, OP_METHODS[op.name][0])(*op.args)
        start(self.recorded)
        return getattr(self._recorded_path, OP_METHODS[op.name][0])(*op.args)

    def _canonicalize(self, seen: Observation, shadow_seen: Observation) -> tuple:
        return canonical_pair(self.recorded, seen, shadow_seen.value)

    def _decision(self, op: ComparedOp) -> tuple:
        """(op request, plan) of ``op``, from the side that planned it (None where none did, or
        its plan path raised before it)."""
        for path in (self._recorded_path, op.shadow):
            if isinstance(path, PlanKvPath):
                return path.last_request, path.last_plan
        return op.decision

    def _outcomes(self, op_name: str, op: ComparedOp, *observations: Observation) -> list[str]:
        """The decision outcomes and interactions a compared op reached (both paths returned; read
        from the op's request, plan and writes, not from ``observations``); then the op joins the
        run's history. Mutates ``history``."""
        request, plan = self._decision(op)
        written, dropped = self.recorded.state.written, self.recorded.dropped
        reached = outcomes_of(op_name, request, plan, written, dropped)
        reached += interactions_of(op_name, request, plan, written, dropped, self.history)
        self.history.record(op_name, request, plan, written)
        return reached

    def _replay(self, comparison, op: ComparedOp) -> dict:
        """What a divergence record of ``op`` carries for replay and minimize. Pure."""
        return op_payload(op.name, self._decision(op)[0], self.recorded, comparison, self.payload)

    def _forward(self, record) -> None:
        """Hand a logged record to ``on_record``, when set."""
        if self.on_record is not None:
            self.on_record(record)
