"""The KV policy's decision catalog, and the classifier that names what each compared op reached.

Every outcome and boundary of the policy (``batchgen.kv.manager``'s docstring) has a stable id
(:data:`DECISIONS`); the catalog adds the interactions where they meet
(``batchgen.shadow.interactions``), counted, reported and required alike.
Each branch of ``KVCacheManager`` and ``LegacyKvPath`` names the ids it decides in a
``# decision:`` comment (``tests/test_coverage.py`` keeps code and catalog in step), and an
``==`` boundary of a comparison is an id of its own (``alloc.exact_fit``: a need exactly equal
to the free pages). Compare mode classifies every compared op from what it already holds: the op
request, the plan, and what the op wrote (:func:`outcomes_of`); the classifier is pure and runs
only in compare mode, never in either path's code.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from batchgen.config import pages_needed
from batchgen.engine.loads import LOAD_TIMEOUT
from batchgen.kv.manager import drop_holds, eviction_watermark_pages
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
from batchgen.shadow.interactions import ALLOC_FITS, INTERACTIONS
from batchgen.state import Phase, RequestState
from compare import Outcome, RunSummary

_SCHEDULER_INVARIANT = (
    "the scheduler admits no request while any is SWAPPED, so RUNNING + LOADING + SWAPPED never "
    "exceeds max_num_seqs and migration never meets the limit (tests/test_coverage.py builds "
    "such a state directly and compares both paths on it)"
)

DECISIONS = (
    Outcome("poll.complete", "poll", "a load landed: RUNNING, its host pages freed"),
    Outcome("poll.retry", "poll", "a failed load is retried, with retries left after it"),
    Outcome("poll.retry.last", "poll", "a failed load takes its last retry (boundary)"),
    Outcome("poll.recompute", "poll", "a failed load with no retry left is recomputed"),
    Outcome("poll.fail", "poll", "a failed load with no retry left fails its request"),
    Outcome("poll.timeout", "poll", "a load that never completed is acted on as failed"),
    Outcome("release.finished", "release", "a finished request (length, eos, abort) released"),
    Outcome("release.failed", "release", "a failed request released"),
    Outcome("release.without_pages", "release", "a released request held no page (WAITING)"),
    Outcome("release.with_host_pages", "release", "a released request held host pages"),
    Outcome("release.with_inflight_load", "release", "a released request's load is drained"),
    Outcome("release.with_pending_append", "release", "a released request's pending K/V dropped"),
    Outcome("evict.none.no_running", "evict", "nothing RUNNING: no victim"),
    Outcome("evict.none.above_watermark", "evict", "free - D > W: no victim"),
    Outcome("evict.none.at_watermark", "evict", "free - D == W: no victim (boundary)"),
    Outcome("evict.to_host", "evict", "a victim's KV stored to host pages"),
    Outcome("evict.to_host.exact_fit", "evict", "the host pool had exactly the victim's pages"),
    Outcome("evict.to_recompute.host_full", "evict", "no host room: a victim dropped to recompute"),
    Outcome("evict.multiple_victims", "evict", "one op took several victims, youngest first"),
    Outcome("evict.stop.above_watermark", "evict", "victims taken until free - D > W"),
    Outcome("evict.stop.at_watermark", "evict", "the last victim brought free - D to W (boundary)"),
    Outcome("evict.all_running", "evict", "every RUNNING request became a victim"),
    Outcome("evict.shared_page_kept", "evict",
            "a victim's page another request holds stays on GPU (prefix caching)"),
    Outcome("migrate.none.nothing_swapped", "migrate", "nothing SWAPPED: no load"),
    Outcome("migrate.skip.swapped_this_step", "migrate", "a request swapped this step stays"),
    Outcome("migrate.load", "migrate", "a SWAPPED request's load starts"),
    Outcome("migrate.load.exact_fit", "migrate", "a load fits with free - D - pages == W"),
    Outcome("migrate.stop.watermark", "migrate", "the next SWAPPED request does not fit: stop"),
    Outcome("migrate.stop.max_num_seqs", "migrate", "max_num_seqs active: stop",
            unreachable=_SCHEDULER_INVARIANT),
    Outcome("migrate.all_loaded", "migrate", "every SWAPPED request not swapped this step loads"),
    Outcome("migrate.relink", "migrate",
            "a load re-links cached prompt pages instead of loading them (prefix caching)"),
    Outcome("alloc.none_needed", "alloc", "every scheduled request fits in the pages it holds"),
    Outcome("alloc.new_page", "alloc", "a RUNNING request gets pages for its new tokens"),
    Outcome("alloc.admit", "alloc", "a WAITING request is admitted with pages for its prompt"),
    Outcome("alloc.exact_fit", "alloc", "a request needs exactly the free pages (boundary)"),
    Outcome("alloc.prefix_hit", "alloc", "an admitted request shares cached prompt pages"),
    Outcome("alloc.prefix_hit.cache_entry", "alloc",
            "a prefix hit takes a free cache entry back off the free queue"),
    Outcome("alloc.does_not_fit", "alloc", "a request is left out: its pages do not fit",
            unreachable=ALLOC_FITS),
    Outcome("alloc.fits_after_does_not_fit", "alloc", "a later request fits after one did not",
            unreachable=ALLOC_FITS),
)  # fmt: skip
CATALOG = DECISIONS + INTERACTIONS  # what reports list and validate requires
OUTCOMES = {outcome.id: outcome for outcome in CATALOG}
REQUIRED = tuple(outcome.id for outcome in CATALOG if outcome.unreachable is None)


def unreached_outcomes(summary: RunSummary) -> tuple[str, ...]:
    """The required outcomes of the ops a run compared that it never reached. Pure."""
    compared = {op for op, count in summary.steps_compared.items() if count}
    return tuple(
        outcome
        for outcome in REQUIRED
        if OUTCOMES[outcome].op in compared and outcome not in summary.coverage
    )


def outcomes_of(
    op: str, request, plan, written: Mapping[str, RequestState], dropped: Collection[str]
) -> list[str]:
    """The outcome ids one compared op reached, from its op request and plan, and the requests
    it wrote (uuid -> the request before the op) and the pending appends it dropped. Pure."""
    if op == "poll":
        return poll_outcomes(request, plan)
    if op == "release":
        return release_outcomes(request, written, dropped)
    if op == "evict":
        return eviction_outcomes(request, plan)
    if op == "migrate":
        return migration_outcomes(request, plan)
    return alloc_outcomes(request, plan)


def poll_outcomes(request: PollRequest, plan: PollPlan) -> list[str]:
    max_retries = request.snapshot.geometry.max_load_retries
    reached = []
    for error, retries, action in zip(request.errors, request.num_load_retries, plan.actions):
        if error is not None and error.startswith(LOAD_TIMEOUT):
            reached.append("poll.timeout")
        if action is PollAction.RETRY:
            reached.append("poll.retry.last" if retries == max_retries - 1 else "poll.retry")
        else:
            reached.append(f"poll.{action.value}")
    return reached


def release_outcomes(
    request: ReleaseRequest, written: Mapping[str, RequestState], dropped: Collection[str]
) -> list[str]:
    reached = []
    for uuid in request.uuids:
        before = written[uuid]
        reached.append("release.failed" if before.phase is Phase.FAILED else "release.finished")
        if not before.gpu_page_ids and not before.host_page_ids:
            reached.append("release.without_pages")
        if before.host_page_ids:
            reached.append("release.with_host_pages")
        if before.load_handle is not None:
            reached.append("release.with_inflight_load")
        if uuid in dropped:
            reached.append("release.with_pending_append")
    return reached


def eviction_outcomes(request: EvictionRequest, plan: EvictionPlan) -> list[str]:
    snapshot, running = request.snapshot, request.running
    if not running.uuids:
        return ["evict.none.no_running"]
    page_size = snapshot.geometry.page_size
    margin = (
        snapshot.num_free_gpu_pages - request.decode_demand - eviction_watermark_pages(snapshot)
    )
    if not plan.victims:
        return ["evict.none.at_watermark" if margin == 0 else "evict.none.above_watermark"]
    reached, free_host = [], snapshot.num_free_host_pages
    holders = dict(request.shared_page_holders)
    for k, victim in enumerate(plan.victims):
        num_pages = len(victim.gpu_page_ids)
        num_tokens = running.num_tokens[_victim_column(running.uuids, k, victim.uuid)]
        freed = drop_holds(victim.gpu_page_ids, holders)
        if freed < num_pages:
            reached.append("evict.shared_page_kept")
        # the pages only it held free up, its demand leaves
        margin += pages_needed(num_tokens, page_size) - (num_pages - freed)
        if victim.destination is Destination.RECOMPUTE:
            reached.append("evict.to_recompute.host_full")
            continue
        reached.append("evict.to_host.exact_fit" if free_host == num_pages else "evict.to_host")
        free_host -= num_pages
    if len(plan.victims) > 1:
        reached.append("evict.multiple_victims")
    if len(plan.victims) == len(running.uuids):
        reached.append("evict.all_running")
    else:
        reached.append("evict.stop.at_watermark" if margin == 0 else "evict.stop.above_watermark")
    return reached


def _victim_column(uuids: tuple[str, ...], k: int, uuid: str) -> int:
    """The column of the ``k``-th victim: the ``k``-th youngest, as the policy takes them (else
    wherever it is). Pure."""
    i = len(uuids) - 1 - k
    return i if i >= 0 and uuids[i] == uuid else uuids.index(uuid)


def migration_outcomes(request: MigrationRequest, plan: MigrationPlan) -> list[str]:
    snapshot, swapped = request.snapshot, request.swapped
    if not swapped.uuids:
        return ["migrate.none.nothing_swapped"]
    reached = []
    margin = (
        snapshot.num_free_gpu_pages - request.decode_demand - eviction_watermark_pages(snapshot)
    )
    num_active = len(request.running.uuids) + request.num_loading
    entries = set(request.cache_entries)
    loaded = iter(plan.loads)
    next_load = next(loaded, None)
    for uuid, host_page_ids, swapped_step in zip(
        swapped.uuids, swapped.host_page_ids, swapped.swapped_steps
    ):
        if swapped_step == snapshot.step:
            reached.append("migrate.skip.swapped_this_step")
        elif next_load is not None and next_load.uuid == uuid:
            relinked = next_load.shared_page_ids
            margin -= len(host_page_ids) - len(relinked) + _taken_entries(relinked, entries)
            reached.append("migrate.load.exact_fit" if margin == 0 else "migrate.load")
            if relinked:
                reached.append("migrate.relink")
            num_active += 1
            next_load = next(loaded, None)
        else:
            at_limit = num_active >= snapshot.geometry.max_num_seqs
            reached.append("migrate.stop.max_num_seqs" if at_limit else "migrate.stop.watermark")
            return reached
    if plan.loads:
        reached.append("migrate.all_loaded")
    return reached


def alloc_outcomes(request: AllocRequest, plan: AllocPlan) -> list[str]:
    needing = request.needing
    if not needing.uuids:
        return ["alloc.none_needed"]
    free, entries = request.snapshot.num_free_gpu_pages, set(request.cache_entries)
    granted = {grant.uuid: grant for grant in plan.grants}
    reached, left_out = [], False
    for uuid, page_ids in zip(needing.uuids, needing.gpu_page_ids):
        grant = granted.get(uuid)
        if grant is None:
            reached.append("alloc.does_not_fit")
            left_out = True
            continue
        reached.append("alloc.new_page" if page_ids else "alloc.admit")  # WAITING holds no page
        if grant.shared_page_ids:
            reached.append("alloc.prefix_hit")
        cost = len(grant.new_page_ids) + _taken_entries(grant.shared_page_ids, entries)
        if len(grant.shared_page_ids) and cost > len(grant.new_page_ids):
            reached.append("alloc.prefix_hit.cache_entry")
        if cost and cost == free:
            reached.append("alloc.exact_fit")
        if left_out:
            reached.append("alloc.fits_after_does_not_fit")
        free -= cost
    return reached


def _taken_entries(page_ids: tuple[int, ...], entries: set[int]) -> int:
    """How many of ``page_ids`` are cache entries still free; those become held. Mutates
    ``entries``."""
    taken = entries.intersection(page_ids)
    entries -= taken
    return len(taken)
