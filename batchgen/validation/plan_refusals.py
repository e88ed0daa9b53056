"""The plan-refusal catalog: malformed plans, each applied to a fresh ``plan_fixture.make_target()``
(after its setup), each refused with ``PlanRejected`` naming its field with its exact message.

One catalog, two users: validate's self-checks (``self_checks``: no sound run of validate trips
these checks, as both KV paths plan well-formed plans, so without it a check weakened into
accepting everything would pass validate) and the applier tests (``tests/test_kv_apply.py``:
each refused with the target untouched). Prefix caching's refusals run on the fixture
``with_cached_prefix``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchgen.kv.plan_checks import PlanRejected
from batchgen.kv.plans import (
    AllocPlan,
    Destination,
    DoesNotFit,
    LoadStart,
    PageGrant,
    PollAction,
    PollPlan,
    ReleasePlan,
    Victim,
)
from batchgen.kv.target import KvTarget
from batchgen.validation.plan_fixture import (
    D0,
    Application,
    alloc,
    grant,
    intruder,
    loads,
    make_target,
    poll,
    poll_plan,
    release,
    set_fields,
    stale_alloc,
    victims,
    with_cached_prefix,
)

COMPLETE, RETRY, FAIL = PollAction.COMPLETE, PollAction.RETRY, PollAction.FAIL
HOST, DROP = Destination.HOST, Destination.RECOMPUTE
FAILED = {"load3": "OSError: injected"}  # load3's load, observed failed
LANDED = {"load3": None}  # load3's load, observed landed
NOT_ONE_OF = (
    "is not one of PollAction.COMPLETE, PollAction.RETRY, PollAction.RECOMPUTE, PollAction.FAIL"
)
NOT_NEEDING = "is not a scheduled request that needs pages"
CACHED = with_cached_prefix


class OtherStr(str):
    """An id of a str subclass (``numpy.str_`` is one): equal to the id, but not a request id."""


@dataclass(frozen=True, slots=True)
class PlanRefusal:
    """One malformed plan: a stable id, what is wrong with it, and the refusal it must get."""

    id: str
    meaning: str
    apply: Application  # applies the plan to the target (PlanRejected when refused)
    field: str  # the field PlanRejected must name
    message: str  # what it must say after "field: "
    setup: Callable[[KvTarget], None] | None = None  # run on the fresh target first


def _r(check_id, meaning, apply: Application, field, message, setup=None) -> PlanRefusal:
    """A refusal whose id is ``plan.`` + ``check_id``."""
    return PlanRefusal(f"plan.{check_id}", meaning, apply, field, message, setup)


RUN1 = PageGrant("run1", (8,))  # what run1's 9 tokens lack: one page
NEITHER = "scheduled requests ['wait4'] need pages and are neither granted them nor left out"
SHARED_AND_NEW = "page 11 is granted new and shared as a cached page in the gpu pool"

PLAN_REFUSALS = (
    # ids: every plan's ids go through one check (_check_ids)
    _r("ids.not_str", "a poll naming its load by an id of a str subclass",
       poll(poll_plan((OtherStr("load3"), COMPLETE)), LANDED), "PollPlan.uuids[0]",
       "'load3' is not a request id"),
    _r("ids.unhashable", "a poll naming its load by an unhashable id",
       poll(poll_plan((["load3"], COMPLETE)), LANDED), "PollPlan.uuids[0]",
       "['load3'] is not a request id"),
    _r("ids.other_type", "a poll naming an int id beside its load",
       poll(PollPlan((3, "load3"), (COMPLETE, COMPLETE), (None, None)), LANDED),
       "PollPlan.uuids[0]", "3 is not a request id"),
    _r("ids.not_tuple", "a poll naming its loads in a list",
       poll(PollPlan(["load3"], (COMPLETE,), (None,)), LANDED), "PollPlan.uuids",
       "must be a tuple of request ids, not list"),
    _r("ids.twice", "an eviction naming its victim twice",
       victims(*(Victim("run1", DROP, (2, 3), ()),) * 2), "EvictionPlan.victims",
       "a request is named twice in ['run1', 'run1']"),
    # poll
    _r("poll.unknown", "a poll of an unknown request",
       poll(poll_plan(("ghost", COMPLETE)), {"ghost": None}), "PollPlan.uuids[0]",
       "unknown request 'ghost'"),
    _r("poll.unobserved", "a poll that leaves an observed load out",
       poll(poll_plan(), LANDED), "PollPlan.uuids", "covers [], observed ['load3']"),
    _r("poll.not_observed", "a poll acting on a load that was not observed",
       poll(poll_plan(("load3", COMPLETE), ("run0", COMPLETE)), LANDED), "PollPlan.uuids",
       "covers ['load3', 'run0'], observed ['load3']"),
    _r("poll.not_loading", "a poll of a request that is not LOADING",
       poll(poll_plan(("load3", COMPLETE), ("run0", COMPLETE)), LANDED | {"run0": None}),
       "PollPlan.uuids[1]", "request 'run0' is RUNNING, expected LOADING"),
    _r("poll.twice", "a poll naming its load twice",
       poll(poll_plan(("load3", COMPLETE), ("load3", COMPLETE)), LANDED), "PollPlan.uuids",
       "a request is named twice in ['load3', 'load3']"),
    _r("poll.complete_failed", "a COMPLETE of a load that failed",
       poll(poll_plan(("load3", COMPLETE)), FAILED), "PollPlan.actions[0]",
       "'load3' load failed; cannot complete"),
    _r("poll.retry_landed", "a RETRY of a load that landed",
       poll(poll_plan(("load3", RETRY)), LANDED), "PollPlan.actions[0]",
       "'load3' load completed; nothing to retry"),
    _r("poll.retry_at_limit", "a RETRY of a load retried max_load_retries (1) times",
       poll(poll_plan(("load3", RETRY)), FAILED), "PollPlan.actions[0]",
       "'load3' has no retries left", set_fields("load3", num_load_retries=1)),
    _r("poll.retry_past_limit", "a RETRY of a load retried more than max_load_retries (1) times",
       poll(poll_plan(("load3", RETRY)), FAILED), "PollPlan.actions[0]",
       "'load3' has no retries left", set_fields("load3", num_load_retries=2)),
    _r("poll.fail_without_reason", "a FAIL without a reason",
       poll(poll_plan(("load3", FAIL)), FAILED), "PollPlan.reasons[0]",
       "failing 'load3' needs a reason (a non-empty str), not None"),
    _r("poll.fail_reason_not_str", "a FAIL whose reason is not a str",
       poll(poll_plan(("load3", FAIL, 123)), FAILED), "PollPlan.reasons[0]",
       "failing 'load3' needs a reason (a non-empty str), not 123"),
    _r("poll.reason_without_fail", "a COMPLETE carrying a failure reason",
       poll(poll_plan(("load3", COMPLETE, "load failed: x")), LANDED), "PollPlan.reasons[0]",
       "'load3' is to complete, not to fail: its reason must be None, not 'load failed: x'"),
    _r("poll.retry_with_reason", "a RETRY carrying a failure reason",
       poll(poll_plan(("load3", RETRY, "load failed: x")), FAILED), "PollPlan.reasons[0]",
       "'load3' is to retry, not to fail: its reason must be None, not 'load failed: x'"),
    _r("poll.action_value", "a RETRY given as its string value",
       poll(poll_plan(("load3", "retry")), FAILED), "PollPlan.actions[0]",
       f"'retry' {NOT_ONE_OF}"),
    _r("poll.complete_value", "a COMPLETE of a landed load given as its string value",
       poll(poll_plan(("load3", "complete")), LANDED), "PollPlan.actions[0]",
       f"'complete' {NOT_ONE_OF}"),
    _r("poll.action_unknown", "an action no PollAction is",
       poll(poll_plan(("load3", "bogus")), FAILED), "PollPlan.actions[0]",
       f"'bogus' {NOT_ONE_OF}"),
    _r("poll.few_actions", "a poll with fewer actions than loads",
       poll(PollPlan(("load3",), (), (None,)), LANDED), "PollPlan.actions",
       "must be a tuple with one entry per load (1), not tuple ()"),
    _r("poll.few_reasons", "a poll with fewer reasons than loads",
       poll(PollPlan(("load3",), (COMPLETE,), ()), LANDED), "PollPlan.reasons",
       "must be a tuple with one entry per load (1), not tuple ()"),
    _r("poll.no_actions", "a poll without an actions column",
       poll(PollPlan(("load3",), None, (None,)), LANDED), "PollPlan.actions",
       "must be a tuple with one entry per load (1), not NoneType None"),
    _r("poll.reasons_list", "a poll giving its reasons in a list",
       poll(PollPlan(("load3",), (COMPLETE,), [None]), LANDED), "PollPlan.reasons",
       "must be a tuple with one entry per load (1), not list [None]"),
    # release
    _r("release.unknown", "a release of an unknown request",
       release(ReleasePlan(("done5", "ghost"), ("done5",))), "ReleasePlan.released[1]",
       "unknown request 'ghost'"),
    _r("release.not_done", "a release of a RUNNING request",
       release(ReleasePlan(("run0",), ())), "ReleasePlan.released[0]",
       "request 'run0' is RUNNING, expected FINISHED/FAILED"),
    _r("release.twice", "a release naming its request twice",
       release(ReleasePlan(("done5", "done5"), ())), "ReleasePlan.released",
       "a request is named twice in ['done5', 'done5']"),
    _r("release.unhashable", "a release naming its request by an unhashable id",
       release(ReleasePlan((["done5"],), (["done5"],))), "ReleasePlan.released[0]",
       "['done5'] is not a request id"),
    _r("release.drop_not_released", "a release dropping the pending append of a live request",
       release(ReleasePlan(("done5",), ("done5", "run1"))),
       "ReleasePlan.drop_pending_append_ids[1]", "'run1' is not being released"),
    _r("release.keeps_append", "a release that keeps the request's pending append",
       release(ReleasePlan(("done5",), ())), "ReleasePlan.drop_pending_append_ids",
       "released ['done5'] would keep their pending appends"),
    _r("release.drop_twice", "a release dropping a pending append twice",
       release(ReleasePlan(("done5",), ("done5", "done5"))),
       "ReleasePlan.drop_pending_append_ids", "a request is named twice in ['done5', 'done5']"),
    # eviction
    _r("evict.unknown", "an eviction of an unknown request",
       victims(Victim("ghost", DROP, (), ())), "EvictionPlan.victims[0].uuid",
       "unknown request 'ghost'"),
    _r("evict.not_running", "an eviction of a SWAPPED request",
       victims(Victim("swap2", DROP, (), ())), "EvictionPlan.victims[0].uuid",
       "request 'swap2' is SWAPPED, expected RUNNING"),
    _r("evict.unhashable", "an eviction naming its victim by an unhashable id",
       victims(Victim(["run1"], DROP, (2, 3), ())), "EvictionPlan.victims[0].uuid",
       "['run1'] is not a request id"),
    _r("evict.second_unhashable", "an eviction naming its second victim by an unhashable id",
       victims(Victim("run0", DROP, (0, 1), ()), Victim(["run1"], DROP, (2, 3), ())),
       "EvictionPlan.victims[1].uuid", "['run1'] is not a request id"),
    _r("evict.stale_gpu_pages", "a victim naming fewer GPU pages than its page table",
       victims(Victim("run1", HOST, (2,), (5,))), "EvictionPlan.victims[0].gpu_page_ids",
       "(2,) != page table (2, 3)"),
    _r("evict.other_gpu_pages", "a victim naming another request's GPU pages",
       victims(Victim("run1", DROP, (0, 1), ())), "EvictionPlan.victims[0].gpu_page_ids",
       "(0, 1) != page table (2, 3)"),
    _r("evict.float_gpu_pages", "a victim naming its GPU pages as floats equal to its table",
       victims(Victim("run1", HOST, (2.0, 3.0), (5, 6))),
       "EvictionPlan.victims[0].gpu_page_ids", "(2.0, 3.0) != page table (2, 3)"),
    _r("evict.gpu_pages_list", "a victim naming its GPU pages in a list",
       victims(Victim("run1", HOST, [2, 3], (5, 6))), "EvictionPlan.victims[0].gpu_page_ids",
       "[2, 3] != page table (2, 3)"),
    _r("evict.host_count", "a victim to host with fewer host pages than GPU pages",
       victims(Victim("run1", HOST, (2, 3), (5,))), "EvictionPlan.victims[0].host_page_ids",
       "1 pages for 2 GPU pages"),
    _r("evict.second_host_count", "a second victim to host with too few host pages",
       victims(Victim("run1", HOST, (2, 3), (5, 6)), Victim("run0", HOST, (0, 1), (7,))),
       "EvictionPlan.victims[1].host_page_ids", "1 pages for 2 GPU pages"),
    _r("evict.recompute_host_pages", "a victim to recompute given host pages",
       victims(Victim("run1", DROP, (2, 3), (5, 6))), "EvictionPlan.victims[0].host_page_ids",
       "2 pages for 0 GPU pages"),
    _r("evict.owned_host_page", "a victim given a host page another request owns",
       victims(Victim("run1", HOST, (2, 3), (5, 0))), "EvictionPlan.victims[0].host_page_ids",
       "page 0 is not free in the host pool"),
    _r("evict.host_page_range", "a victim given a host page out of range",
       victims(Victim("run1", HOST, (2, 3), (5, 8))), "EvictionPlan.victims[0].host_page_ids",
       "page 8 is out of range [0, 8) in the host pool"),
    _r("evict.host_page_twice", "two victims given the same host page",
       victims(Victim("run1", HOST, (2, 3), (5, 6)), Victim("run0", HOST, (0, 1), (6, 7))),
       "EvictionPlan.victims[1].host_page_ids", "page 6 is granted twice in the host pool"),
    _r("evict.host_pages_list", "a victim given its host pages in a list",
       victims(Victim("run1", HOST, (2, 3), [5, 6])), "EvictionPlan.victims[0].host_page_ids",
       "page ids must be a tuple of ints, not list [5, 6]"),
    _r("evict.destination_value", "a destination given as its string value",
       victims(Victim("run1", "host", (2, 3), (5, 6))), "EvictionPlan.victims[0].destination",
       "'host' is not one of Destination.HOST, Destination.RECOMPUTE"),
    # migration
    _r("migrate.unknown", "a load of an unknown request",
       loads(LoadStart("ghost", (8,), (0,))), "MigrationPlan.loads[0].uuid",
       "unknown request 'ghost'"),
    _r("migrate.not_swapped", "a load of a RUNNING request",
       loads(LoadStart("run0", (8, 9), (0, 1))), "MigrationPlan.loads[0].uuid",
       "request 'run0' is RUNNING, expected SWAPPED"),
    _r("migrate.unhashable", "a load naming its request by an unhashable id",
       loads(LoadStart(["swap2"], (8, 9), (0, 1))), "MigrationPlan.loads[0].uuid",
       "['swap2'] is not a request id"),
    _r("migrate.not_str", "a load naming its request by an int",
       loads(LoadStart(2, (8, 9), (0, 1))), "MigrationPlan.loads[0].uuid",
       "2 is not a request id"),
    _r("migrate.twice", "a migration loading a request twice",
       loads(*(LoadStart("swap6", (8,), (4,)),) * 2), "MigrationPlan.loads",
       "a request is named twice in ['swap6', 'swap6']"),
    _r("migrate.host_pages", "a load from host pages not the request's",
       loads(LoadStart("swap2", (8, 9), (1, 0))), "MigrationPlan.loads[0].host_page_ids",
       "(1, 0) != host page table (0, 1)"),
    _r("migrate.gpu_count", "a load into more GPU pages than its host pages",
       loads(LoadStart("swap2", (8, 9, 10), (0, 1))), "MigrationPlan.loads[0].gpu_page_ids",
       "3 pages (re-linked and new) for 2 host pages"),
    _r("migrate.owned_gpu_page", "a load into a GPU page another request owns",
       loads(LoadStart("swap6", (8,), (4,)), LoadStart("swap2", (9, 0), (0, 1))),
       "MigrationPlan.loads[1].gpu_page_ids", "page 0 is not free in the gpu pool"),
    _r("migrate.gpu_page_twice", "a load into one GPU page twice",
       loads(LoadStart("swap2", (8, 8), (0, 1))), "MigrationPlan.loads[0].gpu_page_ids",
       "page ids [8, 8] name a page twice in the gpu pool"),
    _r("migrate.gpu_page_two_loads", "two loads into the same GPU page",
       loads(LoadStart("swap2", (8, 9), (0, 1)), LoadStart("swap6", (9,), (4,))),
       "MigrationPlan.loads[1].gpu_page_ids", "page 9 is granted twice in the gpu pool"),
    _r("migrate.gpu_pages_list", "a load into GPU pages given in a list",
       loads(LoadStart("swap2", [8, 9], (0, 1))), "MigrationPlan.loads[0].gpu_page_ids",
       "page ids must be a tuple of ints, not list [8, 9]"),
    # allocation
    _r("alloc.stale", "an allocation for an op request older than the pool",
       stale_alloc(num_free_gpu_pages=4), "AllocRequest.snapshot",
       "stale: step 7 with 4 free GPU pages, the target is at step 7 with 3", intruder),
    _r("alloc.stale_step", "an allocation for an op request of the step before",
       stale_alloc(step=6), "AllocRequest.snapshot",
       "stale: step 6 with 4 free GPU pages, the target is at step 7 with 4"),
    _r("alloc.unscheduled", "a grant to a request not scheduled",
       grant(RUN1, PageGrant("done5", ())), "AllocPlan.grants[1].uuid",
       f"'done5' {NOT_NEEDING}"),
    _r("alloc.unknown", "a grant to an unknown scheduled request",
       grant(PageGrant("ghost", ()), batch=("ghost",)), "AllocPlan.grants[0].uuid",
       f"'ghost' {NOT_NEEDING}"),
    _r("alloc.swapped", "a grant to a SWAPPED request",
       grant(PageGrant("swap2", (8, 9)), batch=("swap2",)), "AllocPlan.grants[0].uuid",
       "request 'swap2' is SWAPPED, expected RUNNING/WAITING"),
    _r("alloc.needs_none", "a grant to a request that needs no pages",
       grant(PageGrant("run0", ()), RUN1), "AllocPlan.grants[0].uuid", f"'run0' {NOT_NEEDING}"),
    _r("alloc.granted_twice", "a grant to a request twice",
       grant(RUN1, RUN1), "AllocPlan.grants", "a request is named twice in ['run1', 'run1']"),
    _r("alloc.unhashable", "a grant to an unhashable id",
       grant(RUN1, PageGrant(["wait4"], (9, 10))), "AllocPlan.grants[1].uuid",
       "['wait4'] is not a request id"),
    _r("alloc.forgotten", "a scheduled request needing pages neither granted nor left out",
       grant(RUN1), "AllocPlan.grants", NEITHER),
    _r("alloc.admitted_without_grant", "a WAITING request whose pages suffice, not granted",
       grant(batch=("wait4",)), "AllocPlan.grants", NEITHER,
       set_fields("wait4", num_tokens=4, gpu_page_ids=(8,))),
    _r("alloc.left_out_twice", "a request left out twice",
       alloc(AllocPlan((RUN1,), (DoesNotFit("wait4", 2, 1),) * 2)), "AllocPlan.not_fitting",
       "a request is named twice in ['wait4', 'wait4']"),
    _r("alloc.left_out_unhashable", "a request left out by an unhashable id",
       alloc(AllocPlan((RUN1,), (DoesNotFit(["wait4"], 2, 1),))),
       "AllocPlan.not_fitting[0].uuid", "['wait4'] is not a request id"),
    _r("alloc.left_out_needs_none", "a request left out that needs no pages",
       alloc(AllocPlan((RUN1, PageGrant("wait4", (9, 10))), (DoesNotFit("run0", 1, 1),))),
       "AllocPlan.not_fitting[0].uuid", f"'run0' {NOT_NEEDING}, or is also granted"),
    _r("alloc.granted_and_left_out", "a request both granted and left out",
       alloc(AllocPlan((RUN1, PageGrant("wait4", (9, 10))), (DoesNotFit("wait4", 2, 1),))),
       "AllocPlan.not_fitting[0].uuid", f"'wait4' {NOT_NEEDING}, or is also granted"),
    _r("alloc.page_count", "a grant of more pages than the request's tokens lack",
       grant(PageGrant("wait4", (9, 10)), PageGrant("run1", (8, 11))),
       "AllocPlan.grants[1].new_page_ids", "2 pages granted, 1 needed"),
    _r("alloc.owned_page", "a grant of a page another request owns",
       grant(RUN1, PageGrant("wait4", (9, 3))), "AllocPlan.grants[1].new_page_ids",
       "page 3 is not free in the gpu pool"),
    _r("alloc.page_twice", "two grants of the same page",
       grant(RUN1, PageGrant("wait4", (9, 8))), "AllocPlan.grants[1].new_page_ids",
       "page 8 is granted twice in the gpu pool"),
    _r("alloc.pages_list", "a grant of pages given in a list",
       grant(PageGrant("run1", [8]), PageGrant("wait4", (9, 10))),
       "AllocPlan.grants[0].new_page_ids", "page ids must be a tuple of ints, not list [8]"),
    _r("alloc.page_float", "a grant of a page id that is a float",
       grant(RUN1, PageGrant("wait4", (9, 10.0))), "AllocPlan.grants[1].new_page_ids",
       "page id 10.0 is not an int in the gpu pool"),
    _r("alloc.page_unhashable", "a grant of an unhashable page id",
       grant(RUN1, PageGrant("wait4", (9, [10]))), "AllocPlan.grants[1].new_page_ids",
       "page id [10] is not an int in the gpu pool"),
    # prefix caching (with_cached_prefix): a hit's shared pages, a load's re-linked ones
    _r("alloc.shared_list", "a prefix hit's shared pages given in a list",
       grant(RUN1, PageGrant("wait4", (9,), [11])), "AllocPlan.grants[1].shared_page_ids",
       "page ids must be a tuple of ints, not list [11]", CACHED),
    _r("alloc.shared_str", "a prefix hit sharing a page id given as a str",
       grant(RUN1, PageGrant("wait4", (9,), ("11",))), "AllocPlan.grants[1].shared_page_ids",
       "page id '11' is not an int in the gpu pool", CACHED),
    _r("alloc.shared_float", "a prefix hit sharing a page id given as a float",
       grant(RUN1, PageGrant("wait4", (9,), (11.0,))), "AllocPlan.grants[1].shared_page_ids",
       "page id 11.0 is not an int in the gpu pool", CACHED),
    _r("alloc.shared_other_digest", "a prefix hit sharing a page cached at another position",
       grant(RUN1, PageGrant("wait4", (9,), (3,))), "AllocPlan.grants[1].shared_page_ids",
       f"page 3 does not hold the prefix cached as {D0}", CACHED),
    _r("alloc.shared_uncached", "a prefix hit sharing a free page that caches nothing",
       grant(RUN1, PageGrant("wait4", (9,), (10,))), "AllocPlan.grants[1].shared_page_ids",
       f"page 10 does not hold the prefix cached as {D0}", CACHED),
    _r("alloc.shared_past_reusable", "a prefix hit sharing more pages than it may reuse",
       grant(RUN1, PageGrant("wait4", (), (11, 3))), "AllocPlan.grants[1].shared_page_ids",
       "2 cached pages, only 1 reusable", CACHED),
    _r("alloc.shared_running", "a prefix hit for a RUNNING request",
       grant(PageGrant("run1", (8,), (11,)), PageGrant("wait4", (9, 10))),
       "AllocPlan.grants[0].shared_page_ids", "'run1' is RUNNING: no prefix hit", CACHED),
    _r("alloc.shared_and_new", "a page granted both shared and new to one request",
       grant(RUN1, PageGrant("wait4", (11,), (11,))), "AllocPlan.grants[1].new_page_ids",
       SHARED_AND_NEW, CACHED),
    _r("alloc.shared_taken_new", "a cache entry shared by one grant, taken new by an earlier one",
       grant(PageGrant("run1", (11,)), PageGrant("wait4", (9,), (11,))),
       "AllocPlan.grants[0].new_page_ids", SHARED_AND_NEW, CACHED),
    _r("migrate.relink_list", "a load re-linking pages given in a list",
       loads(LoadStart("swap2", (8,), (0, 1), [11])), "MigrationPlan.loads[0].shared_page_ids",
       "page ids must be a tuple of ints, not list [11]", CACHED),
    _r("migrate.relink_str", "a load re-linking a page id given as a str",
       loads(LoadStart("swap2", (8,), (0, 1), ("11",))),
       "MigrationPlan.loads[0].shared_page_ids", "page id '11' is not an int in the gpu pool",
       CACHED),
    _r("migrate.relink_other_digest", "a load re-linking a page cached at another position",
       loads(LoadStart("swap2", (8,), (0, 1), (3,))), "MigrationPlan.loads[0].shared_page_ids",
       f"page 3 does not hold the prefix cached as {D0}", CACHED),
    _r("migrate.relink_past_prompt", "a load re-linking more pages than its prompt has cached",
       loads(LoadStart("swap2", (), (0, 1), (11, 3))), "MigrationPlan.loads[0].shared_page_ids",
       "2 cached pages, only 1 reusable", CACHED),
    _r("migrate.relink_count", "a load whose re-linked and new pages outnumber its host pages",
       loads(LoadStart("swap2", (8, 9), (0, 1), (11,))), "MigrationPlan.loads[0].gpu_page_ids",
       "3 pages (re-linked and new) for 2 host pages", CACHED),
    _r("migrate.relink_taken_new", "a cache entry re-linked by one load, new in an earlier one",
       loads(LoadStart("swap6", (11,), (4,)), LoadStart("swap2", (8,), (0, 1), (11,))),
       "MigrationPlan.loads[0].gpu_page_ids", SHARED_AND_NEW, CACHED),
)  # fmt: skip


def refusal_failure(check: PlanRefusal) -> str | None:
    """None when ``check``'s plan is refused naming its field with its message; else a line naming
    the check and what was accepted (or refused otherwise). Builds and mutates a target of its
    own."""
    target = make_target()
    if check.setup is not None:
        check.setup(target)
    try:
        check.apply(target)
    except PlanRejected as rejected:
        if rejected.field == check.field and str(rejected) == f"{check.field}: {check.message}":
            return None
        return (
            f"self-check {check.id}: {check.meaning} was refused as {rejected}, not as"
            f" {check.field}: {check.message}"
        )
    except Exception as error:  # refused, but not by the plan checks
        return (
            f"self-check {check.id}: {check.meaning} raised {type(error).__name__}: {error}"
            f" instead of PlanRejected naming {check.field}"
        )
    return f"self-check {check.id}: {check.meaning} was accepted; {check.field} must refuse it"
