"""Compare mode for the KV ops: the binding between the worker and ``compare``.

Per compared op (``compare.ShadowExecutor`` fixes the order)::

    context       the op's request (frozen snapshot of its scope): replay input
    shadow        fork the scope's requests and both pools (bookkeeping only: no
                  tensors; the forked host pool records the copies it would issue),
                  run the shadow path on the fork, canonicalise
    authoritative run the authoritative path on the worker with the pools
                  journaling, canonicalise, stop journaling
    compare       canonical forms: scope requests, new outputs, pending appends,
                  counters, each pool's allocator diff, the ordered copy ops

Cost is O(the op's scope): the requests an op may read (RUNNING for evict, the
batch for alloc, ...), never all state. Divergences go to a JSON Lines log with
what ``replay`` needs; each run ends with a summary record.
"""

from __future__ import annotations

import copy
import time
import uuid as uuid_lib
from collections.abc import Callable, Mapping, Sequence

from compare import DivergenceRecord, JsonlSink, Keyed, RunSummary, ShadowExecutor
from batchgen.worker.kv_apply import PlanKvPath, PlanRejected
from batchgen.worker.kv_gate import KvGateConfig, build_kv_path
from batchgen.worker.kv_plans import to_jsonable
from batchgen.worker.kv_target import KvTarget
from batchgen.worker.state import Phase, WorkerState

STAT_FIELDS = ("evictions", "loads", "load_failures", "recompute_preemptions")


def fork_target(target: KvTarget, scope: Sequence[str]) -> KvTarget:
    """A target over copies of the scope's requests and forked pools; the original is untouched."""
    state = target.state
    forked = WorkerState(step=state.step, requests={u: copy.copy(state.requests[u]) for u in scope},
                         stats=copy.copy(state.stats), num_submitted=state.num_submitted)
    gpu = target.gpu_kv.fork()
    host = target.host_kv.fork(gpu)
    pending = {u: target.pending_appends[u] for u in scope if u in target.pending_appends}
    return KvTarget(forked, gpu, host, pending, target.model_config, target.cache_config, target.engine_config)


def canonical_kv(target: KvTarget, scope: Sequence[str], result, gpu_events, host_events, copies) -> dict:
    """The comparable post-state of one op on ``target``. Pure."""
    requests, outputs = Keyed(), Keyed()
    live, done = target.state.requests, target.state.outputs
    for u in scope:
        req = live.get(u)
        if req is not None:
            requests[u] = {
                "phase": req.phase.value, "num_cached_tokens": req.num_cached_tokens,
                "gpu_page_ids": list(req.gpu_page_ids), "host_page_ids": list(req.host_page_ids),
                "num_load_retries": req.num_load_retries, "swapped_step": req.swapped_step,
                "finish_reason": req.finish_reason, "has_load": req.load_handle is not None,
                "load_started_step": req.load_started_step,
                "has_pending_append": u in target.pending_appends,
            }
        elif u in done:
            out = done[u]
            outputs[u] = {"phase": out.phase.value, "finish_reason": out.finish_reason,
                          "num_output_ids": len(out.output_ids),
                          "has_pending_append": u in target.pending_appends}
    stats = target.state.stats
    return {
        "requests": requests,
        "outputs": outputs,
        "stats": {name: getattr(stats, name) for name in STAT_FIELDS},
        "pools": {
            "gpu": [[e.kind, e.uuid, list(e.page_ids)] for e in gpu_events],
            "host": [[e.kind, e.uuid, list(e.page_ids)] for e in host_events],
            "num_free_gpu": target.gpu_kv.free_pages(),
            "num_free_host": target.host_kv.free_pages(),
        },
        "copies": [[c.kind, c.uuid, list(c.src_page_ids), list(c.dst_page_ids)] for c in copies],
        "result": result,
    }


def classify(paths: tuple[str, ...]) -> str:
    return "copies" if all(p.startswith("copies") for p in paths) else "state"


def exception_kind(error: BaseException) -> str:
    return "invalid_plan" if isinstance(error, PlanRejected) else "exception"


class KvCompare:
    """The KV ops with an authoritative path on the worker and a shadow path on forks.

    Same interface as the paths (poll, release, evict, migrate, allocate).
    ``shadow_path`` defaults to the other path; passing the authoritative one
    gives the A/A noise check.
    """

    def __init__(self, target: KvTarget, gate: KvGateConfig, *, shadow_path: str | None = None,
                 sink: JsonlSink | None = None, seed: int = 0):
        self.target = target
        self.gate = gate
        self.authoritative = build_kv_path(gate.path, target)
        self.authoritative_path = gate.path
        self.shadow_path = shadow_path or gate.shadow_path
        self._requests = PlanKvPath(target)  # builds op requests (the replay context)
        self.sink = sink if sink is not None else JsonlSink(gate.compare_log)
        self.seed = seed
        self.run_id = self.workload = self.workload_source = ""
        self.scale = 1.0
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
        self._compare("poll", list(observed), lambda path: path.poll(observed),
                      lambda: self._requests.poll_request(observed))

    def release(self, uuids: Sequence[str]) -> None:
        self._compare("release", list(uuids), lambda path: path.release(uuids),
                      lambda: self._requests.release_request(uuids))

    def evict(self) -> None:
        scope = self._scope(Phase.RUNNING)
        self._compare("evict", scope, lambda path: path.evict(), self._requests.eviction_request)

    def migrate(self) -> None:
        scope = self._scope(Phase.RUNNING, Phase.SWAPPED, Phase.LOADING)
        self._compare("migrate", scope, lambda path: path.migrate(), self._requests.migration_request)

    def allocate(self, batch: Sequence[str]) -> list[str]:
        return self._compare("alloc", list(batch), lambda path: path.allocate(batch),
                             lambda: self._requests.alloc_request(batch))

    # ---- internals -------------------------------------------------------------------------
    def _scope(self, *phases: Phase) -> list[str]:
        return [u for u, r in self.target.state.requests.items() if r.phase in phases]

    def _compare(self, op: str, scope: list[str], call: Callable, request: Callable):
        return self.executor.run(
            op, self.target.state.step,
            context=lambda: (op, request()),
            shadow=lambda: self._run_shadow(scope, call),
            authoritative=lambda: self._run_authoritative(scope, call),
            shadow_path=self.shadow_path, authoritative_path=self.authoritative_path,
        )

    def _run_shadow(self, scope: list[str], call: Callable) -> dict:
        fork = fork_target(self.target, scope)
        result = call(build_kv_path(self.shadow_path, fork))
        return canonical_kv(fork, scope, result, fork.gpu_kv.journal, fork.host_kv.journal, fork.host_kv.copies)

    def _run_authoritative(self, scope: list[str], call: Callable):
        gpu, host = self.target.gpu_kv, self.target.host_kv
        gpu.pages.journal, host.pages.journal, host.copies = [], [], []
        try:
            result = call(self.authoritative)
            return result, canonical_kv(self.target, scope, result, gpu.journal, host.journal, host.copies)
        finally:
            gpu.pages.journal = host.pages.journal = host.copies = None

    def _record(self, comparison, context) -> None:
        op, request = context
        replay = {
            "op": op,
            "request_type": type(request).__name__,
            "request": to_jsonable(request),
            "pools": {name: (seen.value or {}).get("pools") for name, seen in
                      (("authoritative", comparison.authoritative), ("shadow", comparison.shadow))},
            "kv_path": self.authoritative_path,
            "shadow_path": self.shadow_path,
            "workload_source": self.workload_source,
            "scale": self.scale,
        }
        record = DivergenceRecord.from_comparison(comparison, run_id=self.run_id, workload=self.workload,
                                                  seed=self.seed, replay=replay, created_at=time.time())
        self.sink.write(record)
