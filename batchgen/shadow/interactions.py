"""Interactions: where the KV policy's outcomes meet, each with a stable id, and their classifier.

Outcomes (``batchgen.shadow.coverage``) are reached one by one, but a policy breaks where they
meet, so validation must compare those combinations too. Three families::

    evict.seq.*, alloc.seq.*,     sequences inside one op: the destinations of an eviction's
    migrate.seq.*                 victims in order, grants after a does-not-fit, several loads
                                  then a stop at the watermark
    poll.<action>.after_retries_* history: each poll action after 0, 1, 2+ retries of the load;
    evict.victim.*, migrate.load.* a victim whose load landed this or the last step; a load of a
    release.*                     request recomputed before; a release with a load in flight and
                                  a pending append; a release of a request an abort landed on
                                  after it was done
    migrate.skip.evicted_*,       across the ops of one step: a request evicted then skipped by
    alloc.grant.released_*,       migration; pages a release freed granted to another request, or
    alloc.prefix_hit.*            shared by a prefix hit; a prefix hit of a request recomputed
                                  before

An interaction's id starts with the op that reaches it; its ``kind`` is ``interaction``, so
reports count it apart from the outcomes. :func:`interactions_of` is pure given the op input,
the plan, what the op wrote and the run's history (``batchgen.shadow.history``, complete only
when every op of every step is compared: ``batchgen validate`` compares all at sample 1.0).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from batchgen.kv.plans import (
    AllocPlan,
    AllocRequest,
    Destination,
    EvictionPlan,
    EvictionRequest,
    MigrationPlan,
    MigrationRequest,
    PollAction,
    PollPlan,
    PollRequest,
    ReleaseRequest,
)
from batchgen.shadow.history import RunHistory
from batchgen.state import RequestState
from compare import Outcome

ALLOC_FITS = (
    "eviction keeps free - D >= W and the scheduler admits a WAITING request only when its "
    "pages fit above W once every decode has its page, so every scheduled request fits "
    "(tests/test_coverage.py builds such a state directly and compares both paths on it)"
)
NO_PENDING_WHILE_LOADING = (
    "a pending append comes from the last step's forward, which runs only RUNNING requests, and "
    "the only op before release (poll) starts loads only for requests already LOADING, so no "
    "released request has both (tests/test_coverage.py checks it after every step of generated "
    "workloads, and compares both paths on a state built for it)"
)
_RETRIES = ("0", "1", "2plus")
_RETRY_WORDS = {"0": "no retry", "1": "one retry", "2plus": "two or more retries"}
_POLL_ACTIONS = {
    PollAction.COMPLETE: "a load landed",
    PollAction.RETRY: "a failed load is retried",
    PollAction.RECOMPUTE: "a failed load is recomputed",
    PollAction.FAIL: "a failed load fails its request",
}


def _interaction(id: str, meaning: str, unreachable: str | None = None) -> Outcome:
    return Outcome(id, id.partition(".")[0], meaning, unreachable, kind="interaction")


INTERACTIONS = (
    _interaction("evict.seq.host_then_recompute", "one eviction: a victim to host, a later one "
                 "to recompute (the host filled part-way)"),
    _interaction("evict.seq.recompute_then_host", "one eviction: a victim to recompute, a later, "
                 "smaller one to host"),
    _interaction("evict.seq.all_host_last_exact_fit", "one eviction: 2+ victims, all to host, "
                 "the last one filling the host pool exactly"),
    _interaction("evict.seq.host_3plus", "one eviction: 3 or more victims to host (each granted "
                 "the next host page ids)"),
    _interaction("alloc.seq.grants_after_does_not_fit", "one alloc: 2+ grants after a request "
                 "did not fit", unreachable=ALLOC_FITS),
    _interaction("migrate.seq.loads_then_watermark", "one migration: 2+ loads, then the next "
                 "SWAPPED request stops at the watermark"),
    *(
        _interaction(f"poll.{action.value}.after_retries_{n}",
                     f"{meaning}, after {_RETRY_WORDS[n]} of that load")
        for action, meaning in _POLL_ACTIONS.items()
        for n in _RETRIES
    ),
    _interaction("evict.victim.loaded_this_step", "a victim whose load landed this step"),
    _interaction("evict.victim.loaded_last_step", "a victim whose load landed the step before"),
    _interaction("migrate.load.recomputed_before", "a load of a request recomputed before"),
    _interaction("release.inflight_load_and_pending_append", "a released request with a load in "
                 "flight and a pending append", unreachable=NO_PENDING_WHILE_LOADING),
    _interaction("release.abort_after_done", "a released request an abort landed on after it "
                 "was done (finished or failed): the abort changes nothing"),
    _interaction("migrate.skip.evicted_this_step", "a request evicted to host by this step's "
                 "eviction is skipped by its migration"),
    _interaction("alloc.grant.released_pages_this_step", "pages a release freed this step are "
                 "granted to another request"),
    _interaction("alloc.prefix_hit.released_pages_this_step", "a prefix hit shares a cache "
                 "entry a release freed this step (prefix caching)"),
    _interaction("alloc.prefix_hit.recomputed_before", "a request recomputed before is admitted "
                 "again with a prefix hit (prefix caching)"),
)  # fmt: skip


def interactions_of(
    op: str,
    request,
    plan,
    written: Mapping[str, RequestState],
    dropped: Collection[str],
    history: RunHistory,
) -> list[str]:
    """The interaction ids one compared op reached, from its op request and plan, the requests it
    wrote (uuid -> the request before the op), the pending appends it dropped, and the run's
    ``history`` before the op. Pure."""
    if op == "poll":
        return poll_interactions(request, plan)
    if op == "release":
        return release_interactions(request, written, dropped, history)
    if op == "evict":
        return eviction_interactions(request, plan, history)
    if op == "migrate":
        return migration_interactions(request, plan, history)
    return alloc_interactions(request, plan, history)


def poll_interactions(request: PollRequest, plan: PollPlan) -> list[str]:
    return [
        f"poll.{action.value}.after_retries_{_RETRIES[min(retries, 2)]}"
        for retries, action in zip(request.num_load_retries, plan.actions)
    ]


def release_interactions(
    request: ReleaseRequest,
    written: Mapping[str, RequestState],
    dropped: Collection[str],
    history: RunHistory,
) -> list[str]:
    reached = []
    for uuid in request.uuids:
        if written[uuid].load_handle is not None and uuid in dropped:
            reached.append("release.inflight_load_and_pending_append")
        if uuid in history.aborted_done:
            reached.append("release.abort_after_done")
    return reached


def eviction_interactions(
    request: EvictionRequest, plan: EvictionPlan, history: RunHistory
) -> list[str]:
    if not plan.victims:  # most steps: nothing to look at
        return []
    step = request.snapshot.step
    destinations = [victim.destination for victim in plan.victims]
    reached = _orders(destinations)
    num_host = destinations.count(Destination.HOST)
    if num_host >= 2 and num_host == len(destinations):
        num_pages = sum(len(victim.gpu_page_ids) for victim in plan.victims)
        if num_pages == request.snapshot.num_free_host_pages:  # the last one took the rest
            reached.append("evict.seq.all_host_last_exact_fit")
    if num_host >= 3:
        reached.append("evict.seq.host_3plus")
    for victim in plan.victims:
        landed = history.load_landed_steps.get(victim.uuid)
        if landed == step:
            reached.append("evict.victim.loaded_this_step")
        elif landed == step - 1:
            reached.append("evict.victim.loaded_last_step")
    return reached


def _orders(destinations: list[Destination]) -> list[str]:
    """``evict.seq.host_then_recompute`` and ``evict.seq.recompute_then_host``, for each order
    the victims' destinations show. Pure."""
    host, recompute, reached = Destination.HOST, Destination.RECOMPUTE, []
    for first, then, name in ((host, recompute, "host_then_recompute"),
                              (recompute, host, "recompute_then_host")):  # fmt: skip
        if first in destinations and then in destinations[destinations.index(first) + 1 :]:
            reached.append(f"evict.seq.{name}")
    return reached


def migration_interactions(
    request: MigrationRequest, plan: MigrationPlan, history: RunHistory
) -> list[str]:
    snapshot, swapped = request.snapshot, request.swapped
    if not swapped.uuids:  # most steps: nothing to look at
        return []
    evicted = history.this_step(snapshot.step).evicted_to_host
    loaded = {load.uuid for load in plan.loads}
    reached = []
    for uuid, swapped_step in zip(swapped.uuids, swapped.swapped_steps):
        if swapped_step == snapshot.step and uuid in evicted:
            reached.append("migrate.skip.evicted_this_step")
        if uuid in loaded and uuid in history.recomputed:
            reached.append("migrate.load.recomputed_before")
    num_active = len(request.running.uuids) + request.num_loading + len(plan.loads)
    stopped = any(
        uuid not in loaded and swapped_step != snapshot.step
        for uuid, swapped_step in zip(swapped.uuids, swapped.swapped_steps)
    )
    if len(plan.loads) >= 2 and stopped and num_active < snapshot.geometry.max_num_seqs:
        reached.append("migrate.seq.loads_then_watermark")
    return reached


def alloc_interactions(request: AllocRequest, plan: AllocPlan, history: RunHistory) -> list[str]:
    released = history.this_step(request.snapshot.step).released_gpu_page_ids
    reached = [
        "alloc.grant.released_pages_this_step"
        for grant in plan.grants
        if released and not released.isdisjoint(grant.new_page_ids)
    ]
    for grant in plan.grants:
        if grant.shared_page_ids and released and not released.isdisjoint(grant.shared_page_ids):
            reached.append("alloc.prefix_hit.released_pages_this_step")
        if grant.shared_page_ids and grant.uuid in history.recomputed:
            reached.append("alloc.prefix_hit.recomputed_before")
    if not plan.not_fitting:  # every step an engine run takes
        return reached
    left_out = {entry.uuid for entry in plan.not_fitting}
    first_left_out = next(
        (i for i, uuid in enumerate(request.needing.uuids) if uuid in left_out), None
    )
    if first_left_out is not None:
        after = set(request.needing.uuids[first_left_out + 1 :])
        if sum(grant.uuid in after for grant in plan.grants) >= 2:
            reached.append("alloc.seq.grants_after_does_not_fit")
    return reached
