"""Compare mode for the KV ops: the binding between the worker and ``compare``.

Per compared op (``compare.ShadowExecutor`` fixes the order)::

    context       the op being compared; with no plan path on either side (A/A legacy), its op
                  request and plan, built now from the pre-state
    fork          fork the worker's state copy-on-write and overlay both pools (bookkeeping
                  only: no tensors; the forked host pool records the copies it would issue)
    shadow        run the shadow path on the fork; keep its free page counts
    authoritative run the authoritative path on the worker, its pools journaling and its state
                  recording the requests it writes
    canonicalize  both post-states into comparable forms (``forms.canonical_pair``: only what
                  either side wrote)
    compare       the forms; then, when both paths returned, the decision outcomes and the
                  interactions the op reached (``coverage.outcomes_of``, from the plan path's
                  request and plan; ``interactions.interactions_of``, with the run's history,
                  which the op then joins: ``history.RunHistory``)

Only the paths' own exceptions are observations: a failure in forking or canonicalizing is the
harness's (counted, warned, never a divergence, never raised into the worker). Ops the executor
does not sample run the authoritative path alone. Divergences go to a JSON Lines log with what
``replay`` and ``minimize`` need; each run ends with a summary record, decision coverage
included.
"""

from __future__ import annotations

import time
import uuid as uuid_lib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from batchgen.kv.gate import KvGateConfig, build_kv_path, kv_path_class
from batchgen.kv.known_bugs import demo_bug
from batchgen.kv.plan_path import OP_METHODS, PlanKvPath
from batchgen.kv.plans import to_jsonable
from batchgen.kv.target import KvTarget
from batchgen.shadow.coverage import outcomes_of
from batchgen.shadow.fork import fork_target, pre_state
from batchgen.shadow.forms import ShadowRun, canonical_pair, classify, exception_kind
from batchgen.shadow.history import RunHistory
from batchgen.shadow.interactions import interactions_of
from compare import DivergenceRecord, JsonlSink, Observation, RunSummary, ShadowExecutor, Timeline
from compare.budget import RateChange
from compare.governor import SampleGovernor
from compare.records import SampleRateRecord


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
        self.authoritative = build_kv_path(gate.path, target)
        self._planner = PlanKvPath(target)  # reads the pre-state when neither side plans
        self._shadow_class = kv_path_class(self.shadow_path)  # resolved once: no import per op
        self._demo_bug = demo_bug(gate.compare_demo_bug, self.shadow_path)  # planted per fork
        self.sink = JsonlSink(gate.compare_log)
        self.seed, self.scale = 0, 1.0
        self.run_id = self.workload = self.workload_source = ""
        self._op: ComparedOp | None = None
        self._summary: RunSummary | None = None  # the current run's summary, once it ended
        # the worker's page-content oracle (batchgen.engine.kv_verify), when on: runs as this one's
        self.verifier = None
        self.clock = time.perf_counter  # every harness time, the budget's too (tests fake it)
        self.governor: SampleGovernor | None = None  # the run's budget and breaker, when set
        self.on_record = None  # called with each record once it is logged (batchgen.metrics)
        self.executor = self.begin_run("unnamed", seed=0)

    # ---- runs ------------------------------------------------------------------------------
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
        if self.verifier is not None:
            self.verifier.begin_run(
                self.run_id, workload=workload, seed=seed, replay=self._run_replay()
            )
        self.history = RunHistory()  # what the interaction classifier reads of the run so far
        self.executor = ShadowExecutor(
            mode=self.gate.compare,
            sample=self.gate.compare_sample,
            seed=seed,
            ops=self.gate.compare_ops,
            classify=classify,
            exception_kind=exception_kind,
            outcomes=self._outcomes,
            on_divergence=self._record,
            clock=self.clock,
        )
        self.governor = SampleGovernor.from_limits(
            self.executor,
            budget=self.gate.compare_budget,
            max_errors_in_row=self.gate.compare_breaker_errors,
            max_op_seconds=self.gate.compare_breaker_seconds,
            on_change=self._record_rate,
            clock=self.clock,
        )
        return self.executor

    def end_run(
        self, *, stopped_by: str | None = None, timeline: Timeline | None = None
    ) -> RunSummary:
        """Write and return the run's summary record, once: a later call returns the same summary.
        ``stopped_by``: why the run stopped before its work was done (None: it was done);
        ``timeline``: the run's per-step KV counters (``batchgen.engine.timeline``). Mutates self
        and the log."""
        if self._summary is None:
            if self.governor is not None:
                self.governor.finish()
            self._summary = RunSummary.from_stats(
                self.executor.stats(),
                run_id=self.run_id,
                workload=self.workload,
                seed=self.seed,
                authoritative=self.authoritative_path,
                shadow=self.shadow_path,
                stopped_by=stopped_by,
                timeline=timeline,
                data=self.verifier.summary() if self.verifier is not None else None,
                breaker_step=self.governor.breaker_step if self.governor is not None else None,
            )
            self._write(self._summary)
        return self._summary

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
        """Run ``op`` on the authoritative path, and, when the executor samples this step, on the
        shadow path on a fork, and compare. Mutates what the op mutates."""
        step, method = self.target.state.step, OP_METHODS[op][0]
        governor = self.governor
        if governor is not None:
            governor.enter_step(step)
        if not self.executor.should_compare(op, step):
            return getattr(self.authoritative, method)(*args)
        if governor is not None:
            governor.before_op()
        self._op = ComparedOp(op, args)
        if isinstance(self.authoritative, PlanKvPath):
            self.authoritative.last_request = self.authoritative.last_plan = None
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
            self._op = None
            if governor is not None:
                governor.after_op(step)

    def _context(self) -> ComparedOp:
        """The op; with neither side a plan path, its request and plan, planned now (the manager
        is pure) from the pre-state."""
        op = self._op
        if "plan" not in (self.authoritative_path, self.shadow_path):
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
        """The authoritative path on the worker, its pools journaling and its state recording the
        requests it writes and the pending appends it drops, until ``_compare`` ends."""
        self.target.record_op(True)
        return getattr(self.authoritative, OP_METHODS[self._op.name][0])(*self._op.args)

    def _canonicalize(self, seen: Observation, shadow_seen: Observation) -> tuple:
        return canonical_pair(self.target, seen, shadow_seen.value)

    def _decision(self, op: ComparedOp) -> tuple:
        """(op request, plan) of ``op``, from the side that planned it (None where none did, or
        its plan path raised before it)."""
        for path in (self.authoritative, op.shadow):
            if isinstance(path, PlanKvPath):
                return path.last_request, path.last_plan
        return op.decision

    def _outcomes(self, op_name: str, op: ComparedOp) -> list[str]:
        """The decision outcomes and interactions a compared op reached (both paths returned);
        then the op joins the run's history. Mutates ``history``."""
        request, plan = self._decision(op)
        written, dropped = self.target.state.written, self.target.dropped
        reached = outcomes_of(op_name, request, plan, written, dropped)
        reached += interactions_of(op_name, request, plan, written, dropped, self.history)
        self.history.record(op_name, request, plan, written)
        return reached

    def _run_replay(self) -> dict:
        """What minimize needs of the run to rerun its workload (every record carries it). Pure."""
        return {
            "kv_path": self.authoritative_path,
            "shadow_path": self.shadow_path,
            "workload_source": self.workload_source,
            "scale": self.scale,
            # built-in traces draw their token ids, and so their lengths, from it
            "vocab_size": self.target.model_config.vocab_size,
            "engine": self.target.engine_config.model_dump(mode="json"),  # --kv-load-* included
            "faults": self.faults,
            **({"demo_bug": self._demo_bug.demo} if self._demo_bug else {}),  # replay plants it
        }

    def _record(self, comparison, op: ComparedOp) -> None:
        """Log a divergence with what replay and minimize need. Mutates the log."""
        request = self._decision(op)[0]
        pre = None if request is None else pre_state(op.name, request, self.target)
        replay = {
            "op": op.name,
            "request_type": type(request).__name__,
            "request": to_jsonable(request),
            "pre_state": None if pre is None else to_jsonable(pre),
            "pools": {
                "authoritative": (comparison.authoritative.value or {}).get("pools"),
                "shadow": (comparison.shadow.value or {}).get("pools"),
            },
            **self._run_replay(),
        }
        record = DivergenceRecord.from_comparison(
            comparison,
            run_id=self.run_id,
            workload=self.workload,
            seed=self.seed,
            replay=replay,
            created_at=time.time(),
        )
        self._write(record)

    def _record_rate(self, change: RateChange) -> None:
        """Log a change of the sample rate (the budget's or the breaker's). Mutates the log."""
        record = SampleRateRecord.from_change(
            change, run_id=self.run_id, workload=self.workload, seed=self.seed,
            created_at=time.time(),
        )  # fmt: skip
        self._write(record)

    def _write(self, record) -> None:
        """Log ``record``, then hand it to ``on_record``. Mutates the log."""
        self.sink.write(record)
        if self.on_record is not None:
            self.on_record(record)
