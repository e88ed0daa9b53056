"""Legacy and plan paths in lockstep: identical state after every step, copies, and tokens.

Two workers, one per path, receive the same arrivals and aborts and step together; after each KV op
and after each step their canonical dumps (every RequestState field, the load handle as a bool;
outputs; stats; both pools' free queues and owners; pending appends), after each step their KV page
contents, and the copy operations each step issued must be equal. Failed and stalled loads come from
a seeded schedule wrapped around ``host_kv.load_to_gpu_async``, identical on both workers."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kv_dumps import kv_dump

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import WorkloadRequest, builtin_workload
from batchgen.kv.gate import KvGateConfig, build_kv_path
from batchgen.kv.ops import KvFactory, KvSetup
from batchgen.kv.target import KvTarget
from batchgen.model.loader import load_model
from batchgen.model.null_model import NullModel
from batchgen.shadow.recording import RecordingHostPool

PATHS = ("legacy", "plan")
TINY = TINY_MODELS["tiny"]


# ---- load fault injection ------------------------------------------------------------------------
class FailedLoad:
    """The copy ran, but the load reports failure."""

    def __init__(self, inner):
        self.inner = inner

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        self.inner.wait()
        raise OSError("injected load failure")


class StalledLoad:
    """A load that is not done until ``ready_step`` (never, if None): the worker times it out."""

    may_stall = True

    def __init__(self, inner, state, ready_step):
        self.inner, self.state, self.ready_step = inner, state, ready_step

    def done(self) -> bool:
        return self.ready_step is not None and self.state.step >= self.ready_step

    def wait(self) -> None:
        self.inner.wait()


@dataclass(frozen=True)
class LoadFaults:
    seed: int
    fail_rate: float = 0.0
    stall_rate: float = 0.0

    def install(self, worker: Worker) -> None:
        """Wrap the worker's loads: the n-th load's fate depends on (seed, n) only."""
        original = worker.host_kv.load_to_gpu_async
        counter = iter(range(10**9))

        def load_to_gpu_async(uuid, page_ids):
            handle = original(uuid, page_ids)
            rng = random.Random(f"{self.seed}:{next(counter)}")
            roll = rng.random()
            if roll < self.fail_rate:
                return FailedLoad(handle)
            if roll < self.fail_rate + self.stall_rate:
                delay = rng.choice([1, 2, None])
                return StalledLoad(
                    handle, worker.state, None if delay is None else worker.state.step + delay
                )
            return handle

        worker.host_kv.load_to_gpu_async = load_to_gpu_async


def canonical(worker: Worker) -> dict:
    return kv_dump(worker.kv_target(), handles=False)


def settle_loads(worker: Worker) -> None:
    """Let in-flight async copies land (state is unchanged: the worker polls them next step), the
    copies under a stalled load included: the stall is the handle's, the copy still writes its
    pages."""
    for req in worker.state.requests.values():
        handle = req.load_handle
        if isinstance(handle, StalledLoad):
            handle = handle.inner
        elif handle is None or (getattr(handle, "may_stall", False) and not handle.done()):
            continue
        try:
            handle.wait()
        except Exception:
            pass


def assert_same_tensors(legacy: Worker, plan: Worker, step: int) -> None:
    settle_loads(legacy)
    settle_loads(plan)
    for name in ("gpu_kv", "host_kv"):
        a, b = getattr(legacy, name).tensor, getattr(plan, name).tensor
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b), f"step {step}: {name} page contents differ"
    for uuid, p in legacy._pending_kv_append_tensors.items():
        q = plan._pending_kv_append_tensors[uuid]
        assert (p.kv is None and q.kv is None) or torch.equal(p.kv, q.kv), (
            f"step {step}: pending K/V of {uuid}"
        )


def explain(a: dict, b: dict) -> str:
    from deepdiff import DeepDiff

    return DeepDiff(a, b, verbose_level=2).pretty()[:3000]


class OpRecorder:
    """Wraps a worker's KV path; after each op, records the worker's canonical state.

    Comparing per op (not only per step) catches what the step hides, e.g. a pending
    append left behind by release that the flush right after it discards."""

    def __init__(self, worker: Worker):
        self.worker, self.inner = worker, worker._kv
        self.after_ops: list[tuple[str, dict]] = []
        worker._kv = self

    def _record(self, op: str, result=None):
        self.after_ops.append((op, canonical(self.worker)))
        return result

    def poll(self, observed):
        return self._record("poll", self.inner.poll(observed))

    def release(self, uuids):
        return self._record("release", self.inner.release(uuids))

    def evict(self):
        return self._record("evict", self.inner.evict())

    def migrate(self):
        return self._record("migrate", self.inner.migrate())

    def allocate(self, batch):
        return self._record("alloc", self.inner.allocate(batch))


def assert_same_ops(legacy: OpRecorder, plan: OpRecorder, step: int) -> None:
    ops = [op for op, _ in legacy.after_ops]
    assert ops == [op for op, _ in plan.after_ops], (
        f"step {step}: ops {ops} vs {[op for op, _ in plan.after_ops]}"
    )
    for (op, a), (_, b) in zip(legacy.after_ops, plan.after_ops):
        assert a == b, f"state differs after {op} in step {step}:\n{explain(a, b)}"
    legacy.after_ops.clear()
    plan.after_ops.clear()


# ---- lockstep driver -----------------------------------------------------------------------------
def copies_recorded(path: str, hosts: list[RecordingHostPool]) -> KvFactory:
    """The ops of ``path`` over a worker's target whose host pool records each copy the ops issue;
    that pool is appended to ``hosts``."""

    def build(target: KvTarget) -> KvSetup:
        host = RecordingHostPool(target.host_kv)
        host.copies, host.load_handles = [], {}
        hosts.append(host)
        kv_path = build_kv_path(path, dataclasses.replace(target, host_kv=host))
        return KvSetup(kv_path, KvGateConfig(path=path))

    return build


@dataclass
class Trace:
    requests: list[WorkloadRequest]
    cache: CacheConfig
    engine: EngineConfig
    faults: LoadFaults | None = None


def run_lockstep(
    trace: Trace, model, *, kv_storage: bool, max_steps: int = 20_000
) -> tuple[Worker, int]:
    """Step one worker per path together; assert equal canonical state and copies after every step.

    Returns the legacy worker and the number of copies compared."""
    workers, hosts = [], []
    for path in PATHS:
        worker = Worker(
            model,
            cache_config=trace.cache,
            engine_config=trace.engine,
            kv_ops=copies_recorded(path, hosts),
            kv_storage=kv_storage,
        )
        if trace.faults is not None:
            trace.faults.install(worker)
        workers.append(worker)
    legacy, plan = workers
    recorders = [OpRecorder(worker) for worker in workers]
    arrivals = sorted(trace.requests, key=lambda r: r.arrival_step)
    aborts = sorted(
        (r.arrival_step + r.abort_step, r.uuid) for r in trace.requests if r.abort_step is not None
    )
    num_copies = 0
    while arrivals or legacy.has_unfinished() or plan.has_unfinished():
        step = legacy.state.step
        assert step < max_steps, "the trace does not finish"
        while arrivals and arrivals[0].arrival_step <= step:
            request = arrivals.pop(0).to_request()
            for worker in workers:
                worker.add_request(request)
        while aborts and aborts[0][0] <= step:
            uuid = aborts.pop(0)[1]
            assert (uuid in legacy.state.requests) == (uuid in plan.state.requests)
            if uuid in legacy.state.requests:
                for worker in workers:
                    worker.abort(uuid)
        for worker in workers:
            worker.step()
            worker.check_integrity()
        assert_same_ops(*recorders, step)
        a, b = canonical(legacy), canonical(plan)
        assert a == b, f"state differs after step {step}:\n{explain(a, b)}"
        assert hosts[0].copies == hosts[1].copies, f"copies differ at step {step}"
        num_copies += len(hosts[0].copies)
        hosts[0].copies.clear()
        hosts[1].copies.clear()
        if kv_storage:
            assert_same_tensors(legacy, plan, step)
    assert legacy.gpu_kv.free_pages() == legacy.gpu_kv.num_pages
    assert legacy.host_kv.free_pages() == legacy.host_kv.num_pages
    return legacy, num_copies


def trace_of(name: str, faults: LoadFaults | None = None, **cache_changes) -> Trace:
    workload = builtin_workload(name)
    cache = workload.cache.model_copy(update=cache_changes)
    return Trace(list(workload.requests), cache, workload.engine, faults)


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny")


@pytest.mark.parametrize("name", ["smoke", "L2-2048", "L2-4096"])
def test_legacy_and_plan_agree_on_every_step_of_a_builtin_workload(name, tiny_model):
    worker, num_copies = run_lockstep(trace_of(name), tiny_model, kv_storage=True)
    stats = worker.state.stats
    assert stats.evictions > 0 and stats.loads > 0 and num_copies == stats.evictions + stats.loads
    assert all(out.finish_reason == "length" for out in worker.state.outputs.values())


def test_legacy_and_plan_agree_on_smoke_with_failing_and_stalling_loads_and_a_tiny_host_pool(
    tiny_model,
):
    faults = LoadFaults(seed=3, fail_rate=0.5, stall_rate=0.2)
    worker, _ = run_lockstep(
        trace_of("smoke", faults, num_host_pages=6), tiny_model, kv_storage=True
    )
    stats = worker.state.stats
    assert stats.load_failures > 0 and stats.recompute_preemptions > 0


# ---- generated traces ----------------------------------------------------------------------------
@st.composite
def traces(draw) -> Trace:
    """Small, pressured traces: odd page sizes, a GPU pool sized to a fraction of the total demand
    (host pool often smaller still), overlapping arrivals or one burst that finishes together,
    aborts, and a seeded schedule of failed and stalled loads."""
    page_size = draw(st.sampled_from([1, 2, 3, 5, 7, 16]))
    # everyone arrives at once with the same length: they finish together
    burst = draw(st.booleans())
    burst_new = draw(st.integers(1, 16))
    rng = random.Random(draw(st.integers(0, 2**32)))
    requests = []
    for i in range(draw(st.integers(2, 12))):
        total = draw(st.integers(2, 64))
        # decode-heavy
        max_new = (
            min(burst_new, total - 1) if burst else draw(st.integers(max(1, total // 2), total - 1))
        )
        requests.append(
            WorkloadRequest(
                uuid=f"g{i}",
                prompt_ids=[rng.randrange(1, TINY.vocab_size) for _ in range(total - max_new)],
                max_new_tokens=max_new,
                arrival_step=0 if burst else draw(st.integers(0, 6)),
                abort_step=draw(st.none() | st.none() | st.integers(0, 12)),
            )
        )
    pages = [-(-(len(r.prompt_ids) + r.max_new_tokens) // page_size) for r in requests]
    watermark = draw(st.sampled_from([0.0, 0.0, 0.1, 0.3]))
    num_gpu_pages = max(2, round(sum(pages) * draw(st.sampled_from([0.2, 0.3, 0.5, 1.0]))))
    while num_gpu_pages - math.ceil(watermark * num_gpu_pages) < max(pages):
        num_gpu_pages += 1
    num_host_pages = draw(
        st.one_of(st.integers(0, num_gpu_pages - 1), st.integers(num_gpu_pages, 2 * num_gpu_pages))
    )
    cache = CacheConfig(
        page_size=page_size,
        num_gpu_pages=num_gpu_pages,
        num_host_pages=num_host_pages,
        watermark=watermark,
    )
    engine = EngineConfig(
        max_num_seqs=draw(st.integers(2, 8)),
        max_num_batched_tokens=draw(st.integers(8, 128)),
        max_load_retries=draw(st.integers(0, 2)),
        load_timeout_steps=draw(st.integers(1, 3)),
        load_failure=draw(st.sampled_from(["recompute", "fail"])),
    )
    faults = LoadFaults(
        seed=draw(st.integers(0, 2**16)),
        fail_rate=draw(st.sampled_from([0.0, 0.5, 0.8])),
        stall_rate=draw(st.sampled_from([0.0, 0.0, 0.3])),
    )
    return Trace(requests, cache, engine, faults)


def _pressure_example() -> Trace:
    """A pinned example that evicts, migrates, recomputes, fails and stalls loads, and aborts."""
    trace = trace_of("smoke", LoadFaults(seed=1, fail_rate=0.6, stall_rate=0.2), num_host_pages=6)
    trace.engine = trace.engine.model_copy(update={"load_timeout_steps": 2, "load_failure": "fail"})
    trace.requests[2] = trace.requests[2].model_copy(update={"abort_step": 5})
    return trace


def test_legacy_and_plan_agree_on_every_step_of_generated_traces():
    totals: Counter[str] = Counter()
    null_model = NullModel(TINY)

    @settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(traces())
    @example(_pressure_example())
    def check(trace: Trace) -> None:
        worker, num_copies = run_lockstep(trace, null_model, kv_storage=False)
        stats = worker.state.stats
        totals.update(
            evictions=stats.evictions,
            loads=stats.loads,
            load_failures=stats.load_failures,
            recompute_preemptions=stats.recompute_preemptions,
            copies=num_copies,
            traces=1,
            aborts=sum(o.finish_reason == "abort" for o in worker.state.outputs.values()),
            failed=sum(
                (o.finish_reason or "").startswith("load failed")
                for o in worker.state.outputs.values()
            ),
        )

    check()
    assert totals["traces"] >= 50
    for name in (
        "evictions",
        "loads",
        "load_failures",
        "recompute_preemptions",
        "copies",
        "aborts",
        "failed",
    ):
        assert totals[name] > 0, f"no generated trace exercised {name}: {dict(totals)}"
