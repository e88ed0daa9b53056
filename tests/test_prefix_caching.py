"""Prefix caching, as ``batchgen.kv.manager``'s docstring states it, on both KV paths: each test
builds a target by hand, runs one KV op on the plan path and on the legacy path, and expects the
same exact page ids, free queues, digests and counters of both. The pool level is
``test_prefix_pool.py``, whole runs ``test_prefix_runs.py``.

Every target: page_size 4, step 7. Prompts start with ``SYSTEM`` (12 tokens: three full pages,
digests d0, d1, d2) or share nothing; a request holding pages has computed all its tokens but
the last, and the pages of its full prompt pages are indexed as the worker's flush indexes them.
"""

from __future__ import annotations

import pytest

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.kv.backends import CopyOp, GpuKvPool, HostKvPool
from batchgen.kv.legacy import LegacyKvPath
from batchgen.kv.plan_path import PlanKvPath
from batchgen.kv.plans import AllocPlan, DoesNotFit, PageGrant
from batchgen.kv.prefix_digests import prompt_page_digests, register_written_pages, reusable_pages
from batchgen.kv.target import KvTarget
from batchgen.shadow.recording import RecordingHostPool
from batchgen.state import Phase, Request, RequestState, TokenLogprobs, WorkerState

PAGE = 4
SYSTEM = tuple(range(100, 112))
RUNNING, WAITING, SWAPPED, LOADING = Phase.RUNNING, Phase.WAITING, Phase.SWAPPED, Phase.LOADING
D = prompt_page_digests(SYSTEM, PAGE)  # d0, d1, d2
PATHS = {"plan": PlanKvPath, "legacy": LegacyKvPath}


def make_target(num_gpu: int, num_host: int = 8, *, caching=True, watermark=0.0) -> KvTarget:
    """An empty target with bookkeeping pools; the copies ops issue are recorded. Pure."""
    cache = CacheConfig(
        page_size=PAGE, num_gpu_pages=num_gpu, num_host_pages=num_host, watermark=watermark,
        enable_prefix_caching=caching,
    )  # fmt: skip
    gpu = GpuKvPool(num_gpu)
    host = RecordingHostPool(HostKvPool(num_host, None, gpu))
    host.copies, host.load_handles = [], {}
    engine = EngineConfig(max_num_seqs=8, max_load_retries=1)
    return KvTarget(WorkerState(step=7), gpu, host, {}, TINY_MODELS["tiny"], cache, engine)


def add(target, uuid, phase, prompt, *, outputs=0, gpu=(), host=(), **fields) -> RequestState:
    """A request of ``prompt`` and ``outputs`` tokens holding ``gpu`` pages (those held already
    shared) and ``host`` pages, its prompt digests set when caching is on and its written full
    prompt pages indexed. Mutates the target."""
    state, caching = target.state, target.cache_config.enable_prefix_caching
    req = RequestState(
        Request(uuid, tuple(prompt), max_new_tokens=32), arrival_index=len(state.requests),
        phase=phase, output_ids=[7] * outputs,
        output_logprobs=[TokenLogprobs((7, 8), (-0.1, -2.0))] * outputs,
        gpu_page_ids=tuple(gpu), host_page_ids=tuple(host),
        prompt_digests=prompt_page_digests(prompt, PAGE) if caching else (), **fields,
    )  # fmt: skip
    if phase is not WAITING:
        req.num_cached_tokens = req.num_tokens - 1
    shared = tuple(p for p in gpu if not target.gpu_kv.pages.is_free(p))
    target.gpu_kv.grant_pages_for([(uuid, shared, tuple(gpu[len(shared) :]))])
    target.host_kv.take_pages(uuid, list(host))
    state.requests[uuid] = req
    state.num_submitted += 1
    if caching and gpu:
        register_written_pages(target.gpu_kv, req, 0, PAGE)
    return req


def row(req: RequestState) -> tuple:
    return req.phase, req.gpu_page_ids, req.host_page_ids, req.num_cached_tokens


def free_queue(pool) -> list[int]:
    return list(pool.free_page_ids())


@pytest.fixture(params=list(PATHS))
def kv_path(request):
    """A KV path's class: ``kv_path(target)`` runs the ops on ``target``."""
    return PATHS[request.param]


def check(target: KvTarget) -> None:
    target.gpu_kv.check_integrity(target.state.requests)
    target.host_kv.check_integrity(target.state.requests)


# ---- hits ------------------------------------------------------------------------------------
def test_a_waiting_request_shares_the_held_pages_of_its_cached_prefix_then_takes_new_ones(
    kv_path,
):
    target = make_target(12)
    add(target, "a", RUNNING, SYSTEM + (1, 2, 3), outputs=1, gpu=(0, 1, 2, 3))
    b = add(target, "b", WAITING, SYSTEM + (7, 8, 9, 10, 11))  # 17 tokens: 5 pages
    assert kv_path(target).allocate(["a", "b"]) == ["a", "b"]
    assert row(b) == (RUNNING, (0, 1, 2, 4, 5), (), 12)  # 3 hits, 2 new from the queue head
    assert b.num_cached_prompt_tokens == 12
    stats = target.state.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (17, 12)
    assert free_queue(target.gpu_kv) == [6, 7, 8, 9, 10, 11]
    assert target.gpu_kv.shared_pages() == {0: 2, 1: 2, 2: 2}
    check(target)


def test_a_request_admitted_again_counts_its_lookup_but_keeps_its_first_cached_prompt_count(
    kv_path,
):
    target = make_target(12)
    add(target, "a", RUNNING, SYSTEM + (1, 2, 3), outputs=1, gpu=(0, 1, 2, 3))
    b = add(target, "b", WAITING, SYSTEM + (7, 8, 9), outputs=4, num_cached_prompt_tokens=8)
    assert kv_path(target).allocate(["b"]) == ["b"]
    assert (row(b), b.num_cached_prompt_tokens) == ((RUNNING, (0, 1, 2, 4, 5), (), 12), 8)
    stats = target.state.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (19, 12)


def test_a_hit_on_cache_entries_takes_them_off_the_free_queue_keeping_their_digests(kv_path):
    target = make_target(12)
    add(target, "a", Phase.FINISHED, SYSTEM + (1, 2, 3), outputs=1, gpu=(0, 1, 2, 3))
    path = kv_path(target)
    path.release(["a"])
    b = add(target, "b", WAITING, SYSTEM + (7, 8, 9, 10, 11))
    assert path.allocate(["b"]) == ["b"]
    assert row(b) == (RUNNING, (0, 1, 2, 4, 5), (), 12)
    assert free_queue(target.gpu_kv) == [6, 7, 8, 9, 10, 11, 3]
    assert [target.gpu_kv.digest_of(p) for p in (0, 1, 2)] == list(D)
    assert [target.gpu_kv.holders(p) for p in (0, 1, 2)] == [1, 1, 1]
    check(target)


def cache_entries_and_four_pages_held() -> KvTarget:
    """9 GPU pages: a's indexed pages 0-3 released (cache entries 0, 1, 2), c holding 4-7: the
    free queue is 8, 0, 1, 2, 3."""
    target = make_target(9)
    add(target, "a", Phase.FINISHED, SYSTEM + (1, 2, 3), outputs=1, gpu=(0, 1, 2, 3))
    add(target, "c", RUNNING, tuple(range(40, 55)), outputs=1, gpu=(4, 5, 6, 7))
    target.gpu_kv.release_pages("a")
    del target.state.requests["a"]
    return target


def test_the_cache_entries_a_hit_shares_count_against_the_free_pages_an_exact_fit(kv_path):
    target = cache_entries_and_four_pages_held()
    b = add(target, "b", WAITING, SYSTEM + (7, 8, 9, 10, 11))  # 2 new + 3 entries = 5 free
    assert kv_path(target).allocate(["b"]) == ["b"]
    assert row(b) == (RUNNING, (0, 1, 2, 8, 3), (), 12)  # new pages pass over the shared ones
    assert free_queue(target.gpu_kv) == []
    check(target)


def test_a_hit_whose_new_pages_alone_would_fit_does_not_fit_counting_its_cache_entries(
    kv_path,
):
    target = cache_entries_and_four_pages_held()
    b = add(target, "b", WAITING, SYSTEM + tuple(range(1, 10)))  # 3 new + 3 entries = 6 > 5
    path = kv_path(target)
    assert path.allocate(["b"]) == []
    assert row(b) == (WAITING, (), (), 0)
    assert free_queue(target.gpu_kv) == [8, 0, 1, 2, 3]
    if path.name == "plan":
        assert path.last_plan == AllocPlan((), (DoesNotFit("b", 6, 5),))


def test_a_prompt_of_whole_pages_computes_its_last_page_its_hits_stop_one_token_short(kv_path):
    assert (reusable_pages(3, 12, PAGE), reusable_pages(3, 13, PAGE)) == (2, 3)
    target = make_target(12)
    add(target, "a", RUNNING, SYSTEM, outputs=1, gpu=(0, 1, 2, 3))
    b = add(target, "b", WAITING, SYSTEM)
    assert kv_path(target).allocate(["b"]) == ["b"]
    assert row(b) == (RUNNING, (0, 1, 4), (), 8)


def test_a_hit_is_cut_where_an_earlier_request_of_the_same_alloc_took_its_page_as_new(
    kv_path,
):
    """k keeps page 0 (d0) held; a's release leaves d1, d2 on cache entries 1, 2 behind 5, 6 in
    the queue. c, first in the batch, takes 5, 6, 1: b's cached prefix 0, 1 is cut to 0."""
    target = make_target(7)
    add(target, "a", Phase.FINISHED, SYSTEM + (1, 2, 3), outputs=1, gpu=(0, 1, 2, 3))
    add(target, "k", RUNNING, SYSTEM[:4] + (50, 51, 52), outputs=1, gpu=(0, 4))
    path = kv_path(target)
    path.release(["a"])
    assert free_queue(target.gpu_kv) == [5, 6, 1, 2, 3]
    c = add(target, "c", WAITING, tuple(range(60, 69)))
    b = add(target, "b", WAITING, SYSTEM[:8] + (9,))  # may reuse 2 pages: d0, d1
    assert path.allocate(["c", "b"]) == ["c", "b"]
    assert (row(c), row(b)) == ((RUNNING, (5, 6, 1), (), 0), (RUNNING, (0, 2, 3), (), 4))
    assert [target.gpu_kv.digest_of(p) for p in (0, 1, 2)] == [D[0], None, None]
    assert target.gpu_kv.shared_pages() == {0: 2}
    if path.name == "plan":
        assert (path.last_request.cached_pages, path.last_request.cache_entries) == (
            ((), (0, 1)), (1,),
        )  # fmt: skip
        assert path.last_plan == AllocPlan(
            (PageGrant("c", (5, 6, 1)), PageGrant("b", (2, 3), (0,))), ()
        )
    check(target)


# ---- release and reuse -----------------------------------------------------------------------
def test_release_keeps_freed_digests_as_cache_entries_in_lru_order_reuse_drops_them(kv_path):
    target = make_target(8)
    add(target, "a", Phase.FINISHED, SYSTEM + (1, 2, 3), outputs=1, gpu=(0, 1, 2, 3))
    b = add(target, "b", Phase.FINISHED, tuple(range(40, 48)), outputs=1, gpu=(4, 5, 6))
    path = kv_path(target)
    path.release(["a", "b"])
    gpu = target.gpu_kv
    assert free_queue(gpu) == [7, 0, 1, 2, 3, 4, 5, 6]  # released last, reused last
    assert (gpu.cached_prefix(D), gpu.cached_prefix(b.prompt_digests)) == ([0, 1, 2], [4, 5])
    add(target, "x", WAITING, tuple(range(80, 89)))  # 3 new pages, no hit
    assert path.allocate(["x"]) == ["x"]
    assert free_queue(gpu) == [2, 3, 4, 5, 6]
    assert (gpu.digest_of(0), gpu.digest_of(1), gpu.digest_of(2)) == (None, None, D[2])
    assert (gpu.cached_prefix(D), gpu.cached_prefix(b.prompt_digests)) == ([], [4, 5])
    check(target)


# ---- eviction --------------------------------------------------------------------------------
def test_a_victim_copies_all_its_pages_to_host_and_frees_only_those_no_one_else_holds(kv_path):
    target = make_target(6, watermark=0.1)  # keep 1 page free
    a = add(target, "a", RUNNING, SYSTEM + (1, 2, 3), outputs=1, gpu=(0, 1, 2, 3))
    b = add(target, "b", RUNNING, SYSTEM + (7, 8, 9), outputs=2, gpu=(0, 1, 2, 4))  # demand 1
    path = kv_path(target)
    path.evict()  # 1 free - 1 demanded < 1: b goes; its page 4 frees up, 2 - 0 >= 1
    assert (row(a), row(b)) == ((RUNNING, (0, 1, 2, 3), (), 15), (SWAPPED, (), (0, 1, 2, 3), 16))
    assert target.host_kv.copies == [CopyOp("store", "b", (0, 1, 2, 4), (0, 1, 2, 3))]
    assert free_queue(target.gpu_kv) == [5, 4]
    assert target.gpu_kv.shared_pages() == {}
    if path.name == "plan":
        assert path.last_request.shared_page_holders == ((0, 2), (1, 2), (2, 2))
    check(target)


def test_the_watermark_counts_only_the_pages_a_victim_frees_so_a_second_victim_goes(kv_path):
    """Counting b's shared pages as freed would stop after b (4 free - 1 demanded >= 1); only
    page 4 frees up, so a goes too."""
    target = make_target(5, watermark=0.2)  # keep 1 page free
    a = add(target, "a", RUNNING, SYSTEM + (1, 2, 3), outputs=2, gpu=(0, 1, 2, 3))  # demand 1
    b = add(target, "b", RUNNING, SYSTEM + (7, 8, 9), outputs=2, gpu=(0, 1, 2, 4))  # demand 1
    kv_path(target).evict()
    assert (row(a), row(b)) == ((SWAPPED, (), (4, 5, 6, 7), 16), (SWAPPED, (), (0, 1, 2, 3), 16))
    assert target.host_kv.copies == [
        CopyOp("store", "b", (0, 1, 2, 4), (0, 1, 2, 3)),
        CopyOp("store", "a", (0, 1, 2, 3), (4, 5, 6, 7)),
    ]
    assert free_queue(target.gpu_kv) == [4, 0, 1, 2, 3]
    assert target.gpu_kv.cached_prefix(D) == [0, 1, 2]  # kept as cache entries
    assert target.state.stats.evictions == 2


# ---- migration -------------------------------------------------------------------------------
def test_a_load_re_links_the_cached_prompt_pages_and_loads_only_the_rest_retries_included(
    kv_path,
):
    target = make_target(8)
    add(target, "a", RUNNING, SYSTEM + (1, 2, 3), outputs=1, gpu=(0, 1, 2, 3))
    b = add(target, "b", SWAPPED, SYSTEM + (7, 8, 9), outputs=1, host=(0, 1, 2, 3), swapped_step=6)
    path = kv_path(target)
    path.migrate()
    assert row(b) == (LOADING, (0, 1, 2, 4), (3,), 15)  # re-linked, then new
    assert (b.load_page_ids(), b.load_started_step) == ((4,), 7)
    assert free_queue(target.host_kv) == [4, 5, 6, 7, 0, 1, 2]  # the re-linked prefix's: now
    assert free_queue(target.gpu_kv) == [5, 6, 7]
    path.poll({"b": "OSError: injected"})  # retried into the same new page
    assert (row(b), b.num_load_retries) == ((LOADING, (0, 1, 2, 4), (3,), 15), 1)
    assert target.host_kv.copies == [CopyOp("load", "b", (3,), (4,))] * 2
    path.poll({"b": None})
    assert row(b) == (RUNNING, (0, 1, 2, 4), (), 15)
    assert free_queue(target.host_kv) == [4, 5, 6, 7, 0, 1, 2, 3]
    assert (target.state.stats.loads, target.state.stats.load_failures) == (2, 1)
    check(target)


@pytest.mark.parametrize(("watermark", "loads"), [(0.5, True), (0.55, False)])
def test_a_load_re_linking_cache_entries_counts_them_with_its_new_pages(kv_path, watermark, loads):
    """8 free pages, W = 4 (exact fit) or 5: the load costs 1 new page + 3 cache entries."""
    target = make_target(8, watermark=watermark)
    add(target, "a", Phase.FINISHED, SYSTEM + (1, 2, 3), outputs=1, gpu=(0, 1, 2, 3))
    b = add(target, "b", SWAPPED, SYSTEM + (7, 8, 9), outputs=1, host=(0, 1, 2, 3), swapped_step=6)
    path = kv_path(target)
    path.release(["a"])
    path.migrate()
    if loads:
        assert row(b) == (LOADING, (0, 1, 2, 4), (3,), 15)
        assert free_queue(target.gpu_kv) == [5, 6, 7, 3]
    else:
        assert row(b) == (SWAPPED, (), (0, 1, 2, 3), 15)
        assert free_queue(target.gpu_kv) == [4, 5, 6, 7, 0, 1, 2, 3]
    assert target.gpu_kv.cached_prefix(D) == [0, 1, 2]


# ---- caching off -----------------------------------------------------------------------------
def test_with_caching_off_nothing_is_indexed_shared_or_re_linked_and_plans_are_as_before(
    kv_path,
):
    target = make_target(16, caching=False)
    add(target, "a", RUNNING, SYSTEM + (1, 2, 3), outputs=1, gpu=(0, 1, 2, 3))
    s = add(target, "s", SWAPPED, SYSTEM + (4, 5, 6), outputs=1, host=(0, 1, 2, 3), swapped_step=6)
    b = add(target, "b", WAITING, SYSTEM + (7, 8, 9, 10, 11))
    path = kv_path(target)
    path.migrate()
    assert path.allocate(["b"]) == ["b"]
    assert row(s) == (LOADING, (4, 5, 6, 7), (0, 1, 2, 3), 15)
    assert row(b) == (RUNNING, (8, 9, 10, 11, 12), (), 0)
    assert (b.prompt_digests, [target.gpu_kv.digest_of(p) for p in range(16)]) == ((), [None] * 16)
    assert target.host_kv.copies == [CopyOp("load", "s", (0, 1, 2, 3), (4, 5, 6, 7))]
    stats = target.state.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    if path.name == "plan":
        assert (path.last_request.cached_pages, path.last_request.cache_entries) == ((), ())
        assert path.last_plan == AllocPlan((PageGrant("b", (8, 9, 10, 11, 12)),), ())
