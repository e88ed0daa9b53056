"""The plan-refusal catalog: malformed plans, each applied to a fresh ``plan_fixture.make_target()``
(after its setup), each refused with ``PlanRejected`` naming its field with its exact message.

One catalog, two users: validate's self-checks (``self_checks``: no sound run of validate trips
these checks, as both KV paths plan well-formed plans, so without it a check weakened into
accepting everything would pass validate) and the applier tests (``tests/test_kv_apply.py``:
each refused with the target untouched). Prefix caching's refusals run on the fixture
``with_cached_prefix``.
"""

from __future__ import annotations

from batchgen.kv.plans import (
    Destination,
    PollAction,
    PollPlan,
    ReleasePlan,
    Victim,
)
from batchgen.validation.plan_fixture import (
    poll,
    poll_plan,
    release,
    set_fields,
    victims,
)
from batchgen.validation.plan_refusal import refusal
from batchgen.validation.plan_refusals_pages import PAGE_REFUSALS

COMPLETE, RETRY, FAIL = PollAction.COMPLETE, PollAction.RETRY, PollAction.FAIL
HOST, DROP = Destination.HOST, Destination.RECOMPUTE
FAILED = {"load3": "OSError: injected"}  # load3's load, observed failed
LANDED = {"load3": None}  # load3's load, observed landed
NOT_ONE_OF = (
    "is not one of PollAction.COMPLETE, PollAction.RETRY, PollAction.RECOMPUTE, PollAction.FAIL"
)


class OtherStr(str):
    """An id of a str subclass (``numpy.str_`` is one): equal to the id, but not a request id."""


PLAN_REFUSALS = (
    # ids: every plan's ids go through one check (_check_ids)
    refusal("ids.not_str", "a poll naming its load by an id of a str subclass",
       poll(poll_plan((OtherStr("load3"), COMPLETE)), LANDED), "PollPlan.uuids[0]",
       "'load3' is not a request id"),
    refusal("ids.unhashable", "a poll naming its load by an unhashable id",
       poll(poll_plan((["load3"], COMPLETE)), LANDED), "PollPlan.uuids[0]",
       "['load3'] is not a request id"),
    refusal("ids.other_type", "a poll naming an int id beside its load",
       poll(PollPlan((3, "load3"), (COMPLETE, COMPLETE), (None, None)), LANDED),
       "PollPlan.uuids[0]", "3 is not a request id"),
    refusal("ids.not_tuple", "a poll naming its loads in a list",
       poll(PollPlan(["load3"], (COMPLETE,), (None,)), LANDED), "PollPlan.uuids",
       "must be a tuple of request ids, not list"),
    refusal("ids.twice", "an eviction naming its victim twice",
       victims(*(Victim("run1", DROP, (2, 3), ()),) * 2), "EvictionPlan.victims",
       "a request is named twice in ['run1', 'run1']"),
    # poll
    refusal("poll.unknown", "a poll of an unknown request",
       poll(poll_plan(("ghost", COMPLETE)), {"ghost": None}), "PollPlan.uuids[0]",
       "unknown request 'ghost'"),
    refusal("poll.unobserved", "a poll that leaves an observed load out",
       poll(poll_plan(), LANDED), "PollPlan.uuids", "covers [], observed ['load3']"),
    refusal("poll.not_observed", "a poll acting on a load that was not observed",
       poll(poll_plan(("load3", COMPLETE), ("run0", COMPLETE)), LANDED), "PollPlan.uuids",
       "covers ['load3', 'run0'], observed ['load3']"),
    refusal("poll.not_loading", "a poll of a request that is not LOADING",
       poll(poll_plan(("load3", COMPLETE), ("run0", COMPLETE)), LANDED | {"run0": None}),
       "PollPlan.uuids[1]", "request 'run0' is RUNNING, expected LOADING"),
    refusal("poll.twice", "a poll naming its load twice",
       poll(poll_plan(("load3", COMPLETE), ("load3", COMPLETE)), LANDED), "PollPlan.uuids",
       "a request is named twice in ['load3', 'load3']"),
    refusal("poll.complete_failed", "a COMPLETE of a load that failed",
       poll(poll_plan(("load3", COMPLETE)), FAILED), "PollPlan.actions[0]",
       "'load3' load failed; cannot complete"),
    refusal("poll.retry_landed", "a RETRY of a load that landed",
       poll(poll_plan(("load3", RETRY)), LANDED), "PollPlan.actions[0]",
       "'load3' load completed; nothing to retry"),
    refusal("poll.retry_at_limit", "a RETRY of a load retried max_load_retries (1) times",
       poll(poll_plan(("load3", RETRY)), FAILED), "PollPlan.actions[0]",
       "'load3' has no retries left", set_fields("load3", num_load_retries=1)),
    refusal("poll.retry_past_limit",
            "a RETRY of a load retried more than max_load_retries (1) times",
       poll(poll_plan(("load3", RETRY)), FAILED), "PollPlan.actions[0]",
       "'load3' has no retries left", set_fields("load3", num_load_retries=2)),
    refusal("poll.fail_without_reason", "a FAIL without a reason",
       poll(poll_plan(("load3", FAIL)), FAILED), "PollPlan.reasons[0]",
       "failing 'load3' needs a reason (a non-empty str), not None"),
    refusal("poll.fail_reason_not_str", "a FAIL whose reason is not a str",
       poll(poll_plan(("load3", FAIL, 123)), FAILED), "PollPlan.reasons[0]",
       "failing 'load3' needs a reason (a non-empty str), not 123"),
    refusal("poll.reason_without_fail", "a COMPLETE carrying a failure reason",
       poll(poll_plan(("load3", COMPLETE, "load failed: x")), LANDED), "PollPlan.reasons[0]",
       "'load3' is to complete, not to fail: its reason must be None, not 'load failed: x'"),
    refusal("poll.retry_with_reason", "a RETRY carrying a failure reason",
       poll(poll_plan(("load3", RETRY, "load failed: x")), FAILED), "PollPlan.reasons[0]",
       "'load3' is to retry, not to fail: its reason must be None, not 'load failed: x'"),
    refusal("poll.action_value", "a RETRY given as its string value",
       poll(poll_plan(("load3", "retry")), FAILED), "PollPlan.actions[0]",
       f"'retry' {NOT_ONE_OF}"),
    refusal("poll.complete_value", "a COMPLETE of a landed load given as its string value",
       poll(poll_plan(("load3", "complete")), LANDED), "PollPlan.actions[0]",
       f"'complete' {NOT_ONE_OF}"),
    refusal("poll.action_unknown", "an action no PollAction is",
       poll(poll_plan(("load3", "bogus")), FAILED), "PollPlan.actions[0]",
       f"'bogus' {NOT_ONE_OF}"),
    refusal("poll.few_actions", "a poll with fewer actions than loads",
       poll(PollPlan(("load3",), (), (None,)), LANDED), "PollPlan.actions",
       "must be a tuple with one entry per load (1), not tuple ()"),
    refusal("poll.few_reasons", "a poll with fewer reasons than loads",
       poll(PollPlan(("load3",), (COMPLETE,), ()), LANDED), "PollPlan.reasons",
       "must be a tuple with one entry per load (1), not tuple ()"),
    refusal("poll.no_actions", "a poll without an actions column",
       poll(PollPlan(("load3",), None, (None,)), LANDED), "PollPlan.actions",
       "must be a tuple with one entry per load (1), not NoneType None"),
    refusal("poll.reasons_list", "a poll giving its reasons in a list",
       poll(PollPlan(("load3",), (COMPLETE,), [None]), LANDED), "PollPlan.reasons",
       "must be a tuple with one entry per load (1), not list [None]"),
    # release
    refusal("release.unknown", "a release of an unknown request",
       release(ReleasePlan(("done5", "ghost"), ("done5",))), "ReleasePlan.released[1]",
       "unknown request 'ghost'"),
    refusal("release.not_done", "a release of a RUNNING request",
       release(ReleasePlan(("run0",), ())), "ReleasePlan.released[0]",
       "request 'run0' is RUNNING, expected FINISHED/FAILED"),
    refusal("release.twice", "a release naming its request twice",
       release(ReleasePlan(("done5", "done5"), ())), "ReleasePlan.released",
       "a request is named twice in ['done5', 'done5']"),
    refusal("release.unhashable", "a release naming its request by an unhashable id",
       release(ReleasePlan((["done5"],), (["done5"],))), "ReleasePlan.released[0]",
       "['done5'] is not a request id"),
    refusal("release.drop_not_released", "a release dropping the pending append of a live request",
       release(ReleasePlan(("done5",), ("done5", "run1"))),
       "ReleasePlan.drop_pending_append_ids[1]", "'run1' is not being released"),
    refusal("release.keeps_append", "a release that keeps the request's pending append",
       release(ReleasePlan(("done5",), ())), "ReleasePlan.drop_pending_append_ids",
       "released ['done5'] would keep their pending appends"),
    refusal("release.drop_twice", "a release dropping a pending append twice",
       release(ReleasePlan(("done5",), ("done5", "done5"))),
       "ReleasePlan.drop_pending_append_ids", "a request is named twice in ['done5', 'done5']"),
    # eviction
    refusal("evict.unknown", "an eviction of an unknown request",
       victims(Victim("ghost", DROP, (), ())), "EvictionPlan.victims[0].uuid",
       "unknown request 'ghost'"),
    refusal("evict.not_running", "an eviction of a SWAPPED request",
       victims(Victim("swap2", DROP, (), ())), "EvictionPlan.victims[0].uuid",
       "request 'swap2' is SWAPPED, expected RUNNING"),
    refusal("evict.unhashable", "an eviction naming its victim by an unhashable id",
       victims(Victim(["run1"], DROP, (2, 3), ())), "EvictionPlan.victims[0].uuid",
       "['run1'] is not a request id"),
    refusal("evict.second_unhashable", "an eviction naming its second victim by an unhashable id",
       victims(Victim("run0", DROP, (0, 1), ()), Victim(["run1"], DROP, (2, 3), ())),
       "EvictionPlan.victims[1].uuid", "['run1'] is not a request id"),
    refusal("evict.stale_gpu_pages", "a victim naming fewer GPU pages than its page table",
       victims(Victim("run1", HOST, (2,), (5,))), "EvictionPlan.victims[0].gpu_page_ids",
       "(2,) != page table (2, 3)"),
    refusal("evict.other_gpu_pages", "a victim naming another request's GPU pages",
       victims(Victim("run1", DROP, (0, 1), ())), "EvictionPlan.victims[0].gpu_page_ids",
       "(0, 1) != page table (2, 3)"),
    refusal("evict.float_gpu_pages", "a victim naming its GPU pages as floats equal to its table",
       victims(Victim("run1", HOST, (2.0, 3.0), (5, 6))),
       "EvictionPlan.victims[0].gpu_page_ids", "(2.0, 3.0) != page table (2, 3)"),
    refusal("evict.gpu_pages_list", "a victim naming its GPU pages in a list",
       victims(Victim("run1", HOST, [2, 3], (5, 6))), "EvictionPlan.victims[0].gpu_page_ids",
       "[2, 3] != page table (2, 3)"),
    refusal("evict.host_count", "a victim to host with fewer host pages than GPU pages",
       victims(Victim("run1", HOST, (2, 3), (5,))), "EvictionPlan.victims[0].host_page_ids",
       "1 pages for 2 GPU pages"),
    refusal("evict.second_host_count", "a second victim to host with too few host pages",
       victims(Victim("run1", HOST, (2, 3), (5, 6)), Victim("run0", HOST, (0, 1), (7,))),
       "EvictionPlan.victims[1].host_page_ids", "1 pages for 2 GPU pages"),
    refusal("evict.recompute_host_pages", "a victim to recompute given host pages",
       victims(Victim("run1", DROP, (2, 3), (5, 6))), "EvictionPlan.victims[0].host_page_ids",
       "2 pages for 0 GPU pages"),
    refusal("evict.owned_host_page", "a victim given a host page another request owns",
       victims(Victim("run1", HOST, (2, 3), (5, 0))), "EvictionPlan.victims[0].host_page_ids",
       "page 0 is not free in the host pool"),
    refusal("evict.host_page_range", "a victim given a host page out of range",
       victims(Victim("run1", HOST, (2, 3), (5, 8))), "EvictionPlan.victims[0].host_page_ids",
       "page 8 is out of range [0, 8) in the host pool"),
    refusal("evict.host_page_twice", "two victims given the same host page",
       victims(Victim("run1", HOST, (2, 3), (5, 6)), Victim("run0", HOST, (0, 1), (6, 7))),
       "EvictionPlan.victims[1].host_page_ids", "page 6 is granted twice in the host pool"),
    refusal("evict.host_pages_list", "a victim given its host pages in a list",
       victims(Victim("run1", HOST, (2, 3), [5, 6])), "EvictionPlan.victims[0].host_page_ids",
       "page ids must be a tuple of ints, not list [5, 6]"),
    refusal("evict.destination_value", "a destination given as its string value",
       victims(Victim("run1", "host", (2, 3), (5, 6))), "EvictionPlan.victims[0].destination",
       "'host' is not one of Destination.HOST, Destination.RECOMPUTE"),
    *PAGE_REFUSALS,
)  # fmt: skip
