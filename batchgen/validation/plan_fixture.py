"""A small KV target in every request phase, and the builders that apply plans to it: what the
plan-refusal self-checks (``self_checks``) and the applier tests (``tests/test_kv_apply.py``)
build malformed plans against.

The target (``make_target``), page_size 4, GPU pool 12 pages, host pool 8, step 7::

    uuid    phase     tokens  cached  GPU pages  host pages  other
    run0    RUNNING   7       6       0,1        -           demand 0
    run1    RUNNING   9       8       2,3        -           demand 1, pending append
    swap2   SWAPPED   7       6       -          0,1         swapped at step 6
    load3   LOADING   5       4       4,5        2,3         in-flight load, 0 retries
    wait4   WAITING   5       0       -          -
    done5   FINISHED  5       4       6,7        -           pending append
    swap6   SWAPPED   3       2       -          4           swapped at step 6

    GPU free queue 8,9,10,11      host free queue 5,6,7

With ``with_cached_prefix`` (prefix caching on): every prompt starts 1, 2, 3, 4, so every request
with a full prompt page has digest ``D0`` first (run1: ``D0, D1``); ``D0`` is indexed on page 11,
a cache entry (free, the queue unchanged), and ``D1`` on run1's page 3. wait4 (5 tokens) may reuse
one page, swap2 re-link one::

    a valid grant   PageGrant("wait4", (8,), (11,))
    a valid load    LoadStart("swap2", (8,), (0, 1), (11,))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.engine.worker import PendingAppend
from batchgen.kv.appliers import (
    apply_alloc_plan,
    apply_eviction_plan,
    apply_migration_plan,
    apply_poll_plan,
    apply_release_plan,
)
from batchgen.kv.backends import CompletedHandle, GpuKvPool, HostKvPool
from batchgen.kv.plan_path import PlanKvPath
from batchgen.kv.plans import (
    AllocPlan,
    EvictionPlan,
    LoadStart,
    MigrationPlan,
    PageGrant,
    PollPlan,
    ReleasePlan,
    Victim,
)
from batchgen.kv.prefix_digests import prompt_page_digests
from batchgen.kv.target import KvTarget
from batchgen.shadow.recording import RecordingHostPool
from batchgen.state import Phase, Request, RequestState, TokenLogprobs, WorkerState

CACHE = CacheConfig(page_size=4, num_gpu_pages=12, num_host_pages=8, watermark=0.0)
ENGINE = EngineConfig(max_num_seqs=8, max_load_retries=1)
LOGPROBS = TokenLogprobs((5, 6), (-0.1, -2.5))
D0, D1 = prompt_page_digests(tuple(range(1, 9)), CACHE.page_size)  # pages (1..4), (5..8)

# One application of a plan to a target (raises PlanRejected when the plan is refused).
Application = Callable[[KvTarget], object]


def make_target() -> KvTarget:
    """A fresh target as the module docstring draws it: bookkeeping pools (no tensors), the copies
    an op issues recorded (``host_kv.copies``: ``batchgen.shadow.recording``). Pure."""
    state = WorkerState(step=7)
    gpu = GpuKvPool(CACHE.num_gpu_pages)
    host = RecordingHostPool(HostKvPool(CACHE.num_host_pages, None, gpu))
    host.copies, host.load_handles = [], {}

    def add(uuid, phase, prompt_len, num_outputs, cached, *, gpu_ids=(), host_ids=(), **fields):
        req = RequestState(
            Request(uuid, tuple(range(1, prompt_len + 1)), max_new_tokens=16),
            arrival_index=len(state.requests),
            phase=phase,
            output_ids=[5] * num_outputs,
            output_logprobs=[LOGPROBS] * num_outputs,
            num_cached_tokens=cached,
            gpu_page_ids=tuple(gpu_ids),
            host_page_ids=tuple(host_ids),
            **fields,
        )
        if gpu_ids:
            gpu.take_pages(uuid, list(gpu_ids))
        if host_ids:
            host.take_pages(uuid, list(host_ids))
        state.requests[uuid] = req

    add("run0", Phase.RUNNING, 6, 1, 6, gpu_ids=(0, 1))
    add("run1", Phase.RUNNING, 8, 1, 8, gpu_ids=(2, 3))
    add("swap2", Phase.SWAPPED, 5, 2, 6, host_ids=(0, 1), swapped_step=6)
    add(
        "load3", Phase.LOADING, 4, 1, 4, gpu_ids=(4, 5), host_ids=(2, 3),
        load_handle=CompletedHandle(), load_started_step=6, swapped_step=5,
    )  # fmt: skip
    add("wait4", Phase.WAITING, 5, 0, 0)
    add("done5", Phase.FINISHED, 3, 2, 4, gpu_ids=(6, 7), finish_reason="length")
    add("swap6", Phase.SWAPPED, 2, 1, 2, host_ids=(4,), swapped_step=6)
    state.num_submitted = len(state.requests)
    pending = {"run1": PendingAppend(8, None), "done5": PendingAppend(4, None)}
    return KvTarget(state, gpu, host, pending, TINY_MODELS["tiny"], CACHE, ENGINE)


def poll_plan(*steps) -> PollPlan:
    """A PollPlan from (uuid, action) or (uuid, action, reason) rows, in order."""
    rows = [(*step, None)[:3] for step in steps]
    return PollPlan(*(tuple(column) for column in zip(*rows))) if rows else PollPlan((), (), ())


def poll(plan: PollPlan, observed: dict) -> Application:
    """Apply ``plan`` to the loads ``observed`` (uuid -> error, None: landed)."""
    return lambda target: apply_poll_plan(target, plan, observed)


def release(plan: ReleasePlan) -> Application:
    return lambda target: apply_release_plan(target, plan)


def evict(plan: EvictionPlan) -> Application:
    return lambda target: apply_eviction_plan(target, plan)


def migrate(plan: MigrationPlan) -> Application:
    return lambda target: apply_migration_plan(target, plan)


def alloc(plan: AllocPlan, batch=("run0", "run1", "wait4")) -> Application:
    """Apply ``plan`` with the op request of the known scheduled requests, ``batch`` whole."""

    def apply(target):
        known = [uuid for uuid in batch if uuid in target.state.requests]
        request = dataclasses.replace(PlanKvPath(target).alloc_request(known), batch=tuple(batch))
        return apply_alloc_plan(target, plan, request)

    return apply


def grant(*grants: PageGrant, batch=("run0", "run1", "wait4")) -> Application:
    """An allocation of exactly ``grants``, none left out (see :func:`alloc`)."""
    return alloc(AllocPlan(grants, ()), batch)


def victims(*evicted: Victim) -> Application:
    return evict(EvictionPlan(evicted))


def loads(*started: LoadStart) -> Application:
    return migrate(MigrationPlan(started))


def stale_alloc(**snapshot_fields) -> Application:
    """An allocation of run1 and wait4 planned for an op request whose snapshot has
    ``snapshot_fields`` (of an earlier step or pool) instead of the target's."""

    def apply(target: KvTarget):
        request = PlanKvPath(target).alloc_request(["run1", "wait4"])
        stale = dataclasses.replace(
            request, snapshot=dataclasses.replace(request.snapshot, **snapshot_fields)
        )
        plan = AllocPlan((PageGrant("run1", (8,)), PageGrant("wait4", (9, 10))), ())
        return apply_alloc_plan(target, plan, stale)

    return apply


def intruder(target: KvTarget) -> None:
    """A setup: page 11 taken by an owner no plan knows. Mutates the target's GPU pool."""
    target.gpu_kv.take_pages("intruder", [11])


def set_fields(uuid: str, **fields) -> Callable[[KvTarget], None]:
    """A setup that sets ``fields`` on the target's request ``uuid`` (mutates that request)."""

    def change(target):
        for name, value in fields.items():
            setattr(target.state.requests[uuid], name, value)

    return change


def with_cached_prefix(target: KvTarget) -> None:
    """Prefix caching on, as the module docstring draws it: each request's prompt digests set,
    ``D0`` indexed on free page 11 (taken, indexed, released: a cache entry at the queue tail, as
    before) and ``D1`` on run1's page 3. Mutates the target's config, requests and GPU pool."""
    target.cache_config = CACHE.model_copy(update={"enable_prefix_caching": True})
    for req in target.state.requests.values():
        req.prompt_digests = prompt_page_digests(req.request.prompt_ids, CACHE.page_size)
    gpu = target.gpu_kv
    gpu.take_pages("indexer", [11])
    gpu.register(11, D0)
    gpu.release_pages("indexer")
    gpu.register(3, D1)
