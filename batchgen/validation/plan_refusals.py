"""Validate's plan-refusal self-checks: malformed plans, one per check of ``kv.plan_checks`` (and
of the pool's page checks) a planner bug could trip, each applied to a fresh
``plan_fixture.make_target()``; each must be refused with ``PlanRejected`` naming its field.

No sound run of validate trips these checks (both KV paths plan well-formed plans), so without
this catalog a check weakened into accepting everything would pass validate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchgen.kv.appliers import apply_alloc_plan
from batchgen.kv.plan_checks import PlanRejected
from batchgen.kv.plan_path import PlanKvPath
from batchgen.kv.plans import (
    AllocPlan,
    Destination,
    DoesNotFit,
    EvictionPlan,
    LoadStart,
    MigrationPlan,
    PageGrant,
    PollAction,
    PollPlan,
    ReleasePlan,
    Victim,
)
from batchgen.kv.target import KvTarget
from batchgen.validation.plan_fixture import (
    Application,
    alloc,
    evict,
    make_target,
    migrate,
    poll,
    poll_plan,
    release,
    set_fields,
)

COMPLETE, RETRY, FAIL = PollAction.COMPLETE, PollAction.RETRY, PollAction.FAIL
HOST, DROP = Destination.HOST, Destination.RECOMPUTE
FAILED = {"load3": "OSError: injected"}  # load3's load, observed failed
LANDED = {"load3": None}  # load3's load, observed landed


class OtherStr(str):
    """An id of a str subclass (``numpy.str_`` is one): equal to the id, but not a request id."""


@dataclass(frozen=True, slots=True)
class PlanRefusal:
    """One malformed plan: a stable id, what is wrong with it, and the field its refusal names."""

    id: str
    meaning: str
    apply: Application  # applies the plan to the target (PlanRejected when refused)
    field: str  # the field PlanRejected must name
    setup: Callable[[KvTarget], None] | None = None  # run on the fresh target first


def _stale_alloc(target: KvTarget):
    """Allocate with an op request built before a page was taken. Mutates the target's pool."""
    request = PlanKvPath(target).alloc_request(["run1", "wait4"])
    target.gpu_kv.take_pages("intruder", [11])
    plan = AllocPlan((PageGrant("run1", (8,)), PageGrant("wait4", (9, 10))), ())
    return apply_alloc_plan(target, plan, request)


def _r(check_id: str, meaning: str, apply: Application, field: str, setup=None) -> PlanRefusal:
    """A refusal whose id is ``plan.`` + ``check_id``."""
    return PlanRefusal(f"plan.{check_id}", meaning, apply, field, setup)


PLAN_REFUSALS = (
    # ids: every plan's ids go through one check (_check_ids)
    _r("ids.not_str", "a poll naming its load by an id of a str subclass",
       poll(poll_plan((OtherStr("load3"), COMPLETE)), LANDED), "PollPlan.uuids[0]"),
    _r("ids.not_tuple", "a poll naming its loads in a list",
       poll(PollPlan(["load3"], (COMPLETE,), (None,)), LANDED), "PollPlan.uuids"),
    _r("ids.twice", "an eviction naming its victim twice",
       evict(EvictionPlan((Victim("run1", DROP, (2, 3), ()),) * 2)), "EvictionPlan.victims"),
    # poll
    _r("poll.unobserved", "a poll that leaves an observed load out",
       poll(poll_plan(), LANDED), "PollPlan.uuids"),
    _r("poll.not_observed", "a poll acting on a load that was not observed",
       poll(poll_plan(("load3", COMPLETE), ("run0", COMPLETE)), LANDED), "PollPlan.uuids"),
    _r("poll.not_loading", "a poll of a request that is not LOADING",
       poll(poll_plan(("load3", COMPLETE), ("run0", COMPLETE)), LANDED | {"run0": None}),
       "PollPlan.uuids[1]"),
    _r("poll.complete_failed", "a COMPLETE of a load that failed",
       poll(poll_plan(("load3", COMPLETE)), FAILED), "PollPlan.actions[0]"),
    _r("poll.retry_landed", "a RETRY of a load that landed",
       poll(poll_plan(("load3", RETRY)), LANDED), "PollPlan.actions[0]"),
    _r("poll.retry_at_limit", "a RETRY of a load retried max_load_retries (1) times",
       poll(poll_plan(("load3", RETRY)), FAILED), "PollPlan.actions[0]",
       set_fields("load3", num_load_retries=1)),
    _r("poll.retry_past_limit", "a RETRY of a load retried more than max_load_retries (1) times",
       poll(poll_plan(("load3", RETRY)), FAILED), "PollPlan.actions[0]",
       set_fields("load3", num_load_retries=2)),
    _r("poll.fail_without_reason", "a FAIL without a reason",
       poll(poll_plan(("load3", FAIL)), FAILED), "PollPlan.reasons[0]"),
    _r("poll.reason_without_fail", "a COMPLETE carrying a failure reason",
       poll(poll_plan(("load3", COMPLETE, "load failed")), LANDED), "PollPlan.reasons[0]"),
    _r("poll.action_value", "an action given as its string value",
       poll(poll_plan(("load3", "retry")), FAILED), "PollPlan.actions[0]"),
    # release
    _r("release.unknown", "a release of an unknown request",
       release(ReleasePlan(("done5", "ghost"), ("done5",))), "ReleasePlan.released[1]"),
    _r("release.not_done", "a release of a RUNNING request",
       release(ReleasePlan(("run0",), ())), "ReleasePlan.released[0]"),
    _r("release.keeps_append", "a release that keeps the request's pending append",
       release(ReleasePlan(("done5",), ())), "ReleasePlan.drop_pending_append_ids"),
    # eviction
    _r("evict.not_running", "an eviction of a SWAPPED request",
       evict(EvictionPlan((Victim("swap2", DROP, (), ()),))), "EvictionPlan.victims[0].uuid"),
    _r("evict.stale_gpu_pages", "a victim naming fewer GPU pages than its page table",
       evict(EvictionPlan((Victim("run1", HOST, (2,), (5,)),))),
       "EvictionPlan.victims[0].gpu_page_ids"),
    _r("evict.other_gpu_pages", "a victim naming another request's GPU pages",
       evict(EvictionPlan((Victim("run1", DROP, (0, 1), ()),))),
       "EvictionPlan.victims[0].gpu_page_ids"),
    _r("evict.host_count", "a victim to host with fewer host pages than GPU pages",
       evict(EvictionPlan((Victim("run1", HOST, (2, 3), (5,)),))),
       "EvictionPlan.victims[0].host_page_ids"),
    _r("evict.recompute_host_pages", "a victim to recompute given host pages",
       evict(EvictionPlan((Victim("run1", DROP, (2, 3), (5, 6)),))),
       "EvictionPlan.victims[0].host_page_ids"),
    _r("evict.owned_host_page", "a victim given a host page another request owns",
       evict(EvictionPlan((Victim("run1", HOST, (2, 3), (5, 0)),))),
       "EvictionPlan.victims[0].host_page_ids"),
    _r("evict.destination_value", "a destination given as its string value",
       evict(EvictionPlan((Victim("run1", "host", (2, 3), (5, 6)),))),
       "EvictionPlan.victims[0].destination"),
    # migration
    _r("migrate.not_swapped", "a load of a RUNNING request",
       migrate(MigrationPlan((LoadStart("run0", (8, 9), (0, 1)),))),
       "MigrationPlan.loads[0].uuid"),
    _r("migrate.host_pages", "a load from host pages not the request's",
       migrate(MigrationPlan((LoadStart("swap2", (8, 9), (1, 0)),))),
       "MigrationPlan.loads[0].host_page_ids"),
    _r("migrate.gpu_count", "a load into more GPU pages than its host pages",
       migrate(MigrationPlan((LoadStart("swap2", (8, 9, 10), (0, 1)),))),
       "MigrationPlan.loads[0].gpu_page_ids"),
    # allocation
    _r("alloc.stale", "an allocation for an op request older than the pool",
       _stale_alloc, "AllocRequest.snapshot"),
    _r("alloc.page_count", "a grant of more pages than the request's tokens lack",
       alloc(AllocPlan((PageGrant("wait4", (9, 10)), PageGrant("run1", (8, 11))), ())),
       "AllocPlan.grants[1].new_page_ids"),
    _r("alloc.unscheduled", "a grant to a request not scheduled",
       alloc(AllocPlan((PageGrant("run1", (8,)), PageGrant("done5", ())), ())),
       "AllocPlan.grants[1].uuid"),
    _r("alloc.forgotten", "a scheduled request neither granted pages nor left out",
       alloc(AllocPlan((PageGrant("run1", (8,)),), ())), "AllocPlan.grants"),
    _r("alloc.left_out_twice", "a request left out twice",
       alloc(AllocPlan((PageGrant("run1", (8,)),), (DoesNotFit("wait4", 2, 1),) * 2)),
       "AllocPlan.not_fitting"),
    _r("alloc.owned_page", "a grant of a page another request owns",
       alloc(AllocPlan((PageGrant("run1", (8,)), PageGrant("wait4", (9, 3))), ())),
       "AllocPlan.grants[1].new_page_ids"),
)  # fmt: skip


def refusal_failure(check: PlanRefusal) -> str | None:
    """None when ``check``'s plan is refused naming its field; else a line naming the check and
    what was accepted (or refused elsewhere). Builds and mutates a target of its own."""
    target = make_target()
    if check.setup is not None:
        check.setup(target)
    try:
        check.apply(target)
    except PlanRejected as rejected:
        if rejected.field == check.field:
            return None
        return (
            f"self-check {check.id}: {check.meaning} was refused at {rejected.field}, not at"
            f" {check.field}: {rejected}"
        )
    except Exception as error:  # refused, but not by the plan checks
        return (
            f"self-check {check.id}: {check.meaning} raised {type(error).__name__}: {error}"
            f" instead of PlanRejected naming {check.field}"
        )
    return f"self-check {check.id}: {check.meaning} was accepted; {check.field} must refuse it"
