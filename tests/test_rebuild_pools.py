"""The GPU pool a replay rebuilds with prefix caching on, from a hand-written record: pages two
requests hold, the digests its lookups found, a cache entry free in the queue, and the holds of
requests outside the op's scope."""

import pytest

from batchgen.kv.plans import EvictionRequest, KvSnapshot, PageColumns, RequestKvView
from batchgen.triage.rebuild import ReplayError, rebuild_target
from batchgen.triage.rebuild_pools import (
    PLACEHOLDER_OWNER,
    CacheFacts,
    cache_facts,
    gpu_index,
    rebuilt_pool,
)
from batchgen.triage.replay import ReplayOutcome, replay_record
from compare import DivergenceRecord

GEOMETRY = {
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "page_size": 4,
    "dtype_size": 4,
    "num_gpu_pages": 10,
    "num_host_pages": 4,
    "watermark": 0.0,
    "max_num_seqs": 8,
    "max_load_retries": 1,
    "prefix_caching": True,
}
SNAPSHOT = {"step": 7, "geometry": GEOMETRY, "num_free_gpu_pages": 4, "num_free_host_pages": 4}

# uuid, phase, arrival, tokens, cached, gpu pages, host pages, retries, swapped step, prompt tokens,
# prompt digests, cached prompt tokens. a and b share their first two pages (b's were a hit); c's
# prompt is found in a's two pages and cache entry 8; d's first page is held outside the batch.
VIEWS = [
    ["a", "running", 0, 9, 8, [3, 4, 5], [], 0, None, 8, ["d0", "d1"], 0],
    ["b", "running", 1, 10, 9, [3, 4, 6], [], 0, None, 9, ["d0", "d1"], 8],
    ["c", "waiting", 2, 13, 0, [], [], 0, None, 13, ["d0", "d1", "c2"], 0],
    ["d", "waiting", 3, 5, 0, [], [], 0, None, 5, ["x0"], 0],
]
# the legacy path's events: c shares its hits, then takes one page; d shares its hit, takes one
LEGACY_GPU_EVENTS = [
    {"kind": "share", "uuid": "c", "page_ids": [3, 4, 8]},
    {"kind": "alloc", "uuid": "c", "page_ids": [9]},
    {"kind": "share", "uuid": "d", "page_ids": [7]},
    {"kind": "alloc", "uuid": "d", "page_ids": [0]},
]


def cached_alloc_record(*, cache_entries=(8,), views=VIEWS) -> DivergenceRecord:
    """An alloc of batch a, b, c, d whose plan shadow diverged, logged with prefix caching on."""
    request = {
        "snapshot": SNAPSHOT,
        "needing": {"uuids": ["c", "d"], "num_tokens": [13, 5], "gpu_page_ids": [[], []]},
        "batch": ["a", "b", "c", "d"],
        "cached_pages": [[3, 4, 8], [7]],
        "cache_entries": list(cache_entries),
    }
    pools = {
        side: {"gpu": LEGACY_GPU_EVENTS, "host": [], "num_free_gpu": 2, "num_free_host": 4}
        for side in ("authoritative", "shadow")
    }
    replay = {
        "op": "alloc",
        "request_type": "AllocRequest",
        "request": request,
        "pre_state": {"snapshot": SNAPSHOT, "requests": views},
        "pools": pools,
        "kv_path": "legacy",
        "shadow_path": "plan",
        "workload_source": "shared-prefix",
        "scale": 1.0,
    }
    return DivergenceRecord(
        binding="kv",
        run_id="r",
        workload="shared-prefix",
        seed=0,
        step=7,
        op="alloc",
        authoritative="legacy",
        shadow="plan",
        kind="state",
        field_paths=["requests[c].gpu_page_ids[3]"],
        diff={},
        exception=None,
        replay=replay,
        created_at=0.0,
    )


def test_pages_two_requests_name_are_shared_and_indexed_under_their_digests():
    gpu = rebuild_target(cached_alloc_record()).gpu_kv
    assert (gpu.pages_of("a"), gpu.pages_of("b")) == ((3, 4, 5), (3, 4, 6))
    assert gpu.shared_pages() == {3: 2, 4: 2}
    assert [gpu.digest_of(page_id) for page_id in (3, 4, 5, 6)] == ["d0", "d1", None, None]
    gpu.check_integrity()


def test_a_cache_entry_the_op_request_names_is_free_in_the_queue_with_its_digest():
    gpu = rebuild_target(cached_alloc_record()).gpu_kv
    # the legacy side's shares and allocations first, then the other unowned ids ascending
    assert gpu.peek_free_pages(4) == [8, 9, 0, 1]
    assert gpu.digest_of(8) == "c2" and gpu.holders(8) == 0
    assert gpu.cached_prefix(["d0", "d1", "c2"]) == [3, 4, 8]


def test_a_cached_page_no_request_of_the_batch_holds_is_held_by_the_placeholder():
    gpu = rebuild_target(cached_alloc_record()).gpu_kv
    # 7: d's hit, held outside the batch; 2: the page the free count leaves held
    assert gpu.pages_of(PLACEHOLDER_OWNER) == (7, 2)
    assert gpu.cached_prefix(["x0"]) == [7]


def test_the_rebuilt_requests_keep_their_digests_and_cached_prompt_tokens():
    b = rebuild_target(cached_alloc_record()).state.requests["b"]
    assert (b.prompt_digests, b.num_cached_prompt_tokens) == (("d0", "d1"), 8)


def test_the_rebuilt_state_gives_the_recorded_op_request_and_both_paths_agree_on_it():
    assert replay_record(cached_alloc_record()) == ReplayOutcome(False, None, (), {}, ())


def test_a_cache_entry_a_request_holds_is_refused():
    views = [*VIEWS[:3], ["d", "waiting", 3, 5, 0, [8], [], 0, None, 5, ["x0"], 0]]
    with pytest.raises(ReplayError, match=r"^gpu: cache entries \[8\] are held by the scope$"):
        rebuild_target(cached_alloc_record(views=views))


def test_a_cache_entry_in_no_cached_prefix_is_refused():
    with pytest.raises(
        ReplayError, match=r"^the op request's cache entries \[2\] are in no cached prefix$"
    ):
        rebuild_target(cached_alloc_record(cache_entries=(2, 8)))


def test_a_cached_prefix_longer_than_its_prompt_digests_is_refused():
    views = [*VIEWS[:2], ["c", "waiting", 2, 13, 0, [], [], 0, None, 13, ["d0"], 0], VIEWS[3]]
    with pytest.raises(
        ReplayError, match=r"^request c: a cached prefix of 3 pages, but 1 prompt digests$"
    ):
        rebuild_target(cached_alloc_record(views=views))


def test_a_shared_page_without_a_digest_is_refused():
    views = [["a", "running", 0, 9, 8, [3, 4, 5], [], 0, None, 8, [], 0], *VIEWS[1:]]
    views[1] = ["b", "running", 1, 10, 9, [5, 6], [], 0, None, 9, [], 0]
    with pytest.raises(
        ReplayError,
        match=r"^the recorded page tables are inconsistent: gpu: page 5 holds no cached prefix",
    ):
        rebuild_target(cached_alloc_record(views=views))


# ---- evict: the holders beyond the scope's ------------------------------------------------------
def view(row: list) -> RequestKvView:
    """A row of VIEWS as the record reads back."""
    gpu, host, digests = tuple(row[5]), tuple(row[6]), tuple(row[10])
    return RequestKvView(*row[:5], gpu, host, *row[7:10], digests, row[11])


def eviction_request(shared_page_holders) -> EvictionRequest:
    snapshot = KvSnapshot(7, None, 5, 4)  # the facts read no snapshot
    return EvictionRequest(snapshot, PageColumns((), (), ()), 0, shared_page_holders)


def test_an_evicted_page_held_outside_the_scope_more_than_once_has_a_placeholder_per_hold():
    views = [view(VIEWS[0])]  # a holds 3, 4 and 5; 3 has three holders, 4 two, 9 two (both outside)
    facts = cache_facts(eviction_request(((3, 3), (4, 2), (9, 2))), views)
    assert facts == CacheFacts(outside={3: 2, 4: 1, 9: 2})
    digests = gpu_index(views, facts)
    assert digests == {3: "d0", 4: "d1", 9: f"{PLACEHOLDER_OWNER} page 9"}
    pool = rebuilt_pool("gpu", 10, {"a": (3, 4, 5)}, 5, [], digests, facts)
    assert pool.pages_of(PLACEHOLDER_OWNER) == (3, 4, 9, 8)  # 8: left held by the free count
    assert pool.pages_of(f"{PLACEHOLDER_OWNER} #2") == (3, 9)
    assert pool.shared_pages() == {3: 3, 4: 2, 9: 2}
    assert pool.peek_free_pages(5) == [0, 1, 2, 6, 7]
    pool.check_integrity()


def test_fewer_recorded_holders_than_the_scope_names_are_refused():
    with pytest.raises(
        ReplayError,
        match=r"^gpu page 3: 1 holders recorded, but the scope's page tables name it 2 times$",
    ):
        cache_facts(eviction_request(((3, 1),)), [view(row) for row in VIEWS[:2]])
