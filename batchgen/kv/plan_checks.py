"""Checking a plan before it is applied: one pass per plan type, nothing changed.

Each ``check_*`` raises :class:`PlanRejected`, naming the plan field
(``AllocPlan.grants[1].new_page_ids``), unless the plan can be applied to the target as it is: it
names live requests in the phases its op acts on, as ``str`` ids, each once; its enum fields hold
the enum's members (not their string values); its page ids are tuples of ints. Page ids
themselves (in range, free, named once) are checked by the pool as they are taken
(``take_pages``), before any is.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from batchgen.config import pages_needed
from batchgen.kv.page_grants import PageOwnershipError
from batchgen.kv.plans import (
    AllocPlan,
    AllocRequest,
    Destination,
    EvictionPlan,
    MigrationPlan,
    PollAction,
    PollPlan,
    ReleasePlan,
)
from batchgen.kv.prefix_digests import reusable_pages
from batchgen.kv.target import KvTarget
from batchgen.state import DONE_PHASES, Phase, RequestState


class PlanRejected(ValueError):
    """A plan cannot be applied; the target is unchanged."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _check_ids(field: str, item_field: str, uuids: Sequence) -> None:
    """PlanRejected unless ``uuids`` (named ``field``; item i ``item_field.format(i)``) is a
    tuple of ``str`` request ids, each named once."""
    if type(uuids) is not tuple:
        raise PlanRejected(field, f"must be a tuple of request ids, not {type(uuids).__name__}")
    for i, uuid in enumerate(uuids):
        if type(uuid) is not str:
            raise PlanRejected(item_field.format(i), f"{uuid!r} is not a request id")
    if len(set(uuids)) != len(uuids):
        raise PlanRejected(field, f"a request is named twice in {list(uuids)}")


def _request(target: KvTarget, field: str, uuid: str, phases: Collection[Phase]) -> RequestState:
    """The live request ``uuid`` if it is in one of ``phases``; else PlanRejected naming
    ``field`` and why."""
    req = target.state.requests.get(uuid)
    if req is None:
        raise PlanRejected(field, f"unknown request {uuid!r}")
    if req.phase not in phases:
        allowed = "/".join(p.name for p in phases)
        raise PlanRejected(field, f"request {uuid!r} is {req.phase.name}, expected {allowed}")
    return req


def _check_member(field: str, value, enum_type) -> None:
    """PlanRejected unless ``value`` is an ``enum_type`` member (str enums equal their values:
    the type is checked, not equality)."""
    if type(value) is not enum_type:
        allowed = ", ".join(f"{enum_type.__name__}.{member.name}" for member in enum_type)
        raise PlanRejected(field, f"{value!r} is not one of {allowed}")


def _is_page_tuple(page_ids) -> bool:
    return type(page_ids) is tuple and all(type(page_id) is int for page_id in page_ids)


def _check_page_tuple(field: str, page_ids) -> None:
    if type(page_ids) is not tuple:
        raise PlanRejected(
            field, f"page ids must be a tuple of ints, not {type(page_ids).__name__} {page_ids!r}"
        )


def take_pages(pool, grants: list[tuple[str, tuple[int, ...]]], field: str) -> None:
    """Give each owner its page ids: all checked by the pool, then all taken; else PlanRejected
    naming the refused grant (``field`` with ``{}`` for its index), nothing taken. Mutates the
    pool."""
    try:
        pool.take_pages_for(grants)
    except PageOwnershipError as refused:
        message = f"{refused.reason} in the {pool.pages.name} pool"
        raise PlanRejected(field.format(refused.index), message) from None


def grant_pages(pool, grants: list[tuple], field: str, *, new: str) -> None:
    """Give each owner (``grants``: owner, cached page ids, new page ids) its cached pages shared,
    then its new pages: all checked by the pool, then all granted; else PlanRejected naming the
    refused grant (``field`` with ``{}`` for its index, then ``{}`` for ``shared_page_ids`` or
    ``new``, the new ids' field name), nothing granted. Mutates the pool."""
    try:
        pool.grant_pages_for(grants)
    except PageOwnershipError as refused:
        part = "shared_page_ids" if refused.part == "shared" else new
        message = f"{refused.reason} in the {pool.pages.name} pool"
        raise PlanRejected(field.format(refused.index, part), message) from None


def check_poll_plan(target: KvTarget, plan: PollPlan, observed: Mapping[str, str | None]) -> None:
    """PlanRejected unless ``plan`` acts once on each observed load, in order of its rows, with
    an action the load's outcome allows. Pure."""
    uuids = plan.uuids
    _check_ids("PollPlan.uuids", "PollPlan.uuids[{}]", uuids)
    if set(uuids) != observed.keys():
        raise PlanRejected("PollPlan.uuids", f"covers {sorted(uuids)}, observed {sorted(observed)}")
    for name, column in (("actions", plan.actions), ("reasons", plan.reasons)):
        if type(column) is not tuple or len(column) != len(uuids):
            raise PlanRejected(
                f"PollPlan.{name}",
                f"must be a tuple with one entry per load ({len(uuids)}), not "
                f"{type(column).__name__} {column!r}",
            )
    for i, (uuid, action, reason) in enumerate(zip(uuids, plan.actions, plan.reasons)):
        req = _request(target, f"PollPlan.uuids[{i}]", uuid, (Phase.LOADING,))
        _check_poll_row(target, i, req, action, reason, observed[uuid])


def _check_poll_row(target: KvTarget, i: int, req: RequestState, action, reason, error) -> None:
    """PlanRejected naming row ``i`` unless ``action`` (with ``reason``) is one the load of
    ``req``, observed with ``error`` (None: it landed), allows: complete a landed load; retry a
    failed one with retries left; recompute it; or fail it with a reason (a non-empty str). A
    reason goes with FAIL only. Pure."""
    field, uuid = f"PollPlan.actions[{i}]", req.uuid
    _check_member(field, action, PollAction)
    if action is PollAction.COMPLETE and error is not None:
        raise PlanRejected(field, f"{uuid!r} load failed; cannot complete")
    if action is not PollAction.COMPLETE and error is None:
        raise PlanRejected(field, f"{uuid!r} load completed; nothing to {action.value}")
    if action is PollAction.RETRY and req.num_load_retries >= target.engine_config.max_load_retries:
        raise PlanRejected(field, f"{uuid!r} has no retries left")
    field = f"PollPlan.reasons[{i}]"
    if action is PollAction.FAIL and (type(reason) is not str or not reason):
        raise PlanRejected(
            field, f"failing {uuid!r} needs a reason (a non-empty str), not {reason!r}"
        )
    if action is not PollAction.FAIL and reason is not None:
        raise PlanRejected(
            field,
            f"{uuid!r} is to {action.value}, not to fail: its reason must be None, not {reason!r}",
        )


def check_release_plan(target: KvTarget, plan: ReleasePlan) -> None:
    """PlanRejected unless ``plan`` releases done requests, each once, and drops the pending
    append of each released request that has one, of no other. Pure."""
    _check_ids("ReleasePlan.released", "ReleasePlan.released[{}]", plan.released)
    for i, uuid in enumerate(plan.released):
        _request(target, f"ReleasePlan.released[{i}]", uuid, DONE_PHASES)
    field = "ReleasePlan.drop_pending_append_ids"
    _check_ids(field, field + "[{}]", plan.drop_pending_append_ids)
    released, drops = set(plan.released), set(plan.drop_pending_append_ids)
    for i, uuid in enumerate(plan.drop_pending_append_ids):
        if uuid not in released:
            raise PlanRejected(f"{field}[{i}]", f"{uuid!r} is not being released")
    stranded = [u for u in plan.released if u not in drops and target.has_pending_append(u)]
    if stranded:
        raise PlanRejected(field, f"released {stranded} would keep their pending appends")


def check_eviction_plan(target: KvTarget, plan: EvictionPlan) -> None:
    """PlanRejected unless each victim is a RUNNING request named once, with its GPU page table
    as it is, a Destination, and host page ids for each GPU page when it goes to host (none for
    recompute). The host ids themselves are checked by the pool as they are taken. Pure."""
    victims = plan.victims
    ids = tuple(victim.uuid for victim in victims)
    _check_ids("EvictionPlan.victims", "EvictionPlan.victims[{}].uuid", ids)
    for i, victim in enumerate(victims):
        field = f"EvictionPlan.victims[{i}]"
        req = _request(target, f"{field}.uuid", victim.uuid, (Phase.RUNNING,))
        gpu_page_ids = victim.gpu_page_ids
        if not _is_page_tuple(gpu_page_ids) or gpu_page_ids != req.gpu_page_ids:
            raise PlanRejected(
                f"{field}.gpu_page_ids", f"{gpu_page_ids!r} != page table {req.gpu_page_ids}"
            )
        _check_member(f"{field}.destination", victim.destination, Destination)
        _check_page_tuple(f"{field}.host_page_ids", victim.host_page_ids)
        want = len(gpu_page_ids) if victim.destination is Destination.HOST else 0
        if len(victim.host_page_ids) != want:
            raise PlanRejected(
                f"{field}.host_page_ids",
                f"{len(victim.host_page_ids)} pages for {want} GPU pages",
            )


def check_migration_plan(target: KvTarget, plan: MigrationPlan) -> None:
    """PlanRejected unless each load is of a SWAPPED request named once, from its host pages,
    into a tuple of as many GPU page ids (checked by the pool as they are taken). Pure."""
    ids = tuple(load.uuid for load in plan.loads)
    _check_ids("MigrationPlan.loads", "MigrationPlan.loads[{}].uuid", ids)
    for i, load in enumerate(plan.loads):
        field = f"MigrationPlan.loads[{i}]"
        req = _request(target, f"{field}.uuid", load.uuid, (Phase.SWAPPED,))
        if load.host_page_ids != req.host_page_ids:
            raise PlanRejected(
                f"{field}.host_page_ids",
                f"{load.host_page_ids} != host page table {req.host_page_ids}",
            )
        _check_page_tuple(f"{field}.gpu_page_ids", load.gpu_page_ids)
        _check_page_tuple(f"{field}.shared_page_ids", load.shared_page_ids)
        _check_cached(target, f"{field}.shared_page_ids", load.shared_page_ids, req.prompt_digests)
        num_pages = len(load.shared_page_ids) + len(load.gpu_page_ids)
        if num_pages != len(req.host_page_ids):
            raise PlanRejected(
                f"{field}.gpu_page_ids",
                f"{num_pages} pages (re-linked and new) for {len(req.host_page_ids)} host pages",
            )


def check_alloc_plan(target: KvTarget, plan: AllocPlan, request: AllocRequest) -> None:
    """PlanRejected unless ``request`` is of the target's step and free GPU pages, and ``plan``
    grants or leaves out each request it lists as needing pages, once, naming no other, each
    grant a tuple of exactly the pages its tokens lack (checked by the pool as they are taken).
    Pure."""
    snapshot, free = request.snapshot, target.gpu_kv.pages.num_free
    if snapshot.step != target.state.step or snapshot.num_free_gpu_pages != free:
        raise PlanRejected(
            "AllocRequest.snapshot",
            f"stale: step {snapshot.step} with {snapshot.num_free_gpu_pages} free GPU pages, the "
            f"target is at step {target.state.step} with {free}",
        )
    granted = tuple(grant.uuid for grant in plan.grants)
    left_out = tuple(entry.uuid for entry in plan.not_fitting)
    _check_ids("AllocPlan.grants", "AllocPlan.grants[{}].uuid", granted)
    _check_ids("AllocPlan.not_fitting", "AllocPlan.not_fitting[{}].uuid", left_out)
    needing, granted_ids, left_out_ids = set(request.needing.uuids), set(granted), set(left_out)
    for i, uuid in enumerate(granted):
        if uuid not in needing:
            raise PlanRejected(
                f"AllocPlan.grants[{i}].uuid",
                f"{uuid!r} is not a scheduled request that needs pages",
            )
    for i, uuid in enumerate(left_out):
        if uuid not in needing or uuid in granted_ids:
            raise PlanRejected(
                f"AllocPlan.not_fitting[{i}].uuid",
                f"{uuid!r} is not a scheduled request that needs pages, or is also granted",
            )
    missing = [u for u in request.needing.uuids if u not in granted_ids and u not in left_out_ids]
    if missing:
        raise PlanRejected(
            "AllocPlan.grants",
            f"scheduled requests {missing} need pages and are neither granted them nor left out",
        )
    for i, grant in enumerate(plan.grants):
        _check_grant(target, i, grant)


def _check_grant(target: KvTarget, i: int, grant) -> None:
    field = f"AllocPlan.grants[{i}]"
    req = _request(target, f"{field}.uuid", grant.uuid, (Phase.RUNNING, Phase.WAITING))
    _check_page_tuple(f"{field}.new_page_ids", grant.new_page_ids)
    shared = grant.shared_page_ids
    _check_page_tuple(f"{field}.shared_page_ids", shared)
    page_size = target.cache_config.page_size
    if shared and req.phase is Phase.RUNNING:
        raise PlanRejected(f"{field}.shared_page_ids", f"{grant.uuid!r} is RUNNING: no prefix hit")
    usable = reusable_pages(len(req.prompt_digests), req.num_tokens, page_size)
    _check_cached(target, f"{field}.shared_page_ids", shared, req.prompt_digests[:usable])
    need = max(0, pages_needed(req.num_tokens, page_size) - len(req.gpu_page_ids) - len(shared))
    if len(grant.new_page_ids) != need:
        raise PlanRejected(
            f"{field}.new_page_ids", f"{len(grant.new_page_ids)} pages granted, {need} needed"
        )


def _check_cached(target: KvTarget, field: str, page_ids: tuple, digests: tuple[str, ...]) -> None:
    """PlanRejected unless each of ``page_ids`` is the GPU page cached under the digest at its
    position in ``digests`` (a prefix of them). An id that is not an int is left to the pool,
    which refuses it as it is granted (``grant_pages``). Pure."""
    if len(page_ids) > len(digests):
        raise PlanRejected(field, f"{len(page_ids)} cached pages, only {len(digests)} reusable")
    pool = target.gpu_kv
    for page_id, digest in zip(page_ids, digests):
        if type(page_id) is int and (
            not 0 <= page_id < pool.num_pages or pool.digest_of(page_id) != digest
        ):
            raise PlanRejected(field, f"page {page_id} does not hold the prefix cached as {digest}")
