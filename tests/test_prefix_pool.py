"""Prefix caching at the pool level: ``PagePool``'s holders, digest index and cache entries, the
same answers from compare mode's overlay of it (``ForkedPagePool``), and the integrity check that
catches their corruption. The policy the KV paths build on it: ``test_prefix_caching.py``."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.kv.page_grants import PageOwnershipError
from batchgen.kv.page_pool import PagePool
from batchgen.shadow.forked_pages import ForkedPagePool

NUM_PAGES = 10
DIGESTS = tuple(f"d{i}" for i in range(5))
OWNERS = "abcd"


def cached_pool(num_pages: int = 8) -> PagePool:
    """8 pages: a held 0-3 with d0, d1, d2 on 0-2 and released them (cache entries at the tail);
    b holds 4, 5 with d3 on 4: free queue 6, 7, 0, 1, 2, 3 (6, 7, 8, 9, 0, ... with 10 pages)."""
    pool = PagePool("gpu", num_pages)
    pool.allocate_pages("a", 4)
    pool.allocate_pages("b", 2)
    for page_id, digest in zip((0, 1, 2, 4), ("d0", "d1", "d2", "d3")):
        pool.register(page_id, digest)
    pool.release_pages("a")
    return pool


@pytest.fixture(params=["pool", "fork"])
def pool(request):
    """``cached_pool()`` itself, or an overlay of it (which must answer the same)."""
    base = cached_pool()
    return base if request.param == "pool" else ForkedPagePool(base)


# ---- the bookkeeping, on a pool and on its fork -------------------------------------------------
def test_a_freed_page_keeps_its_digest_a_free_cache_entry_at_the_queue_tail(pool):
    assert list(pool.free_page_ids()) == [6, 7, 0, 1, 2, 3]
    assert [pool.digest_of(p) for p in range(8)] == ["d0", "d1", "d2", None, "d3", None, None, None]
    assert (pool.num_free, pool.cached_prefix(["d0", "d1", "d2", "d9"])) == (6, [0, 1, 2])


def test_a_grant_shares_held_pages_and_cache_entries_first_then_takes_new_ones(pool):
    pool.grant_pages_for([("c", (0, 1), (6,)), ("d", (0, 4), (7, 2))])
    assert (pool.pages_of("c"), pool.pages_of("d")) == ((0, 1, 6), (0, 4, 7, 2))
    assert list(pool.free_page_ids()) == [3]
    assert [pool.holders(p) for p in range(8)] == [2, 1, 1, 0, 2, 1, 1, 1]
    assert pool.shared_pages() == {0: 2, 4: 2}
    # the shared entries keep their digests; 2, taken as a new page, lost its own
    assert [pool.digest_of(p) for p in range(5)] == ["d0", "d1", None, None, "d3"]
    assert pool.cached_prefix(["d0", "d1", "d2"]) == [0, 1]


def test_an_allocation_from_the_head_drops_the_digests_of_the_entries_it_takes(pool):
    assert pool.allocate_pages("c", 3) == [6, 7, 0]
    assert (pool.digest_of(0), pool.cached_prefix(["d0", "d1"])) == (None, [])
    assert pool.digest_of(1) == "d1"  # still an entry, reached by no prefix


def test_release_of_first_pages_drops_only_those_holds(pool):
    pool.grant_pages_for([("c", (0, 1), (6,))])
    pool.release_first_pages("b", 1)  # 4 is b's alone: freed, keeping d3
    assert (pool.pages_of("b"), list(pool.free_page_ids())) == ((5,), [7, 2, 3, 4])
    pool.grant_pages_for([("d", (0,), ())])
    pool.release_first_pages("c", 2)  # 0 is d's too: stays held
    assert (pool.pages_of("c"), list(pool.free_page_ids())) == ((6,), [7, 2, 3, 4, 1])
    with pytest.raises(ValueError, match=r"^gpu: c holds 1 pages, not 2$"):
        pool.release_first_pages("c", 2)


@pytest.mark.parametrize(
    ("grants", "message"),
    [
        ([("c", (3,), ())], "gpu: page 3 holds no cached prefix (it has no digest)"),
        ([("b", (4,), ())], "gpu: page 4 would be named twice in b's page table"),
        ([("c", (0,), (0,))], "gpu: page 0 is granted new and shared as a cached page"),
        (
            [("c", (), (0,)), ("d", (0,), ())],
            "gpu: page 0 is granted new and shared as a cached page",
        ),
        ([("c", (1,), (5,))], "gpu: page 5 is not free"),
    ],
    ids=["no digest", "held by its owner", "shared and new", "new then shared", "new held"],
)
def test_a_refused_grant_names_the_first_bad_page_and_changes_nothing(pool, grants, message):
    before = (list(pool.free_page_ids()), [pool.holders(p) for p in range(8)])
    with pytest.raises(PageOwnershipError) as refused:
        pool.grant_pages_for(grants)
    assert str(refused.value) == message
    assert (list(pool.free_page_ids()), [pool.holders(p) for p in range(8)]) == before


def test_only_a_held_page_is_indexed_and_only_once():
    pool = cached_pool()
    with pytest.raises(ValueError, match=r"^gpu: page 3 is free; only a held page is indexed$"):
        pool.register(3, "d9")
    assert pool.register(5, "d3") is False  # d3 is 4's
    assert pool.register(4, "d9") is False  # 4 holds d3
    assert (pool.register(5, "d9"), pool.cached_prefix(["d9"])) == (True, [5])


# ---- a fork answers every query as its base would ----------------------------------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "grant", "any_grant", "release", "release_first", "register"]),
        st.sampled_from(OWNERS),
        st.integers(0, 4),
        st.integers(0, 2**NUM_PAGES - 1),
    ),
    max_size=20,
)


def op_call(op, answers: PagePool):
    """One op as a call on a pool, its arguments read from ``answers`` (the pool before it). The
    call returns what the op gave, or the error it raised, and mutates its pool. Pure."""
    kind, owner, n, bits = op
    if kind == "alloc":
        return lambda pool: pool.allocate_pages(owner, min(n, answers.num_free))
    if kind == "release":
        return lambda pool: pool.release_pages(owner)
    if kind == "release_first":
        return lambda pool: pool.release_first_pages(owner, min(n, len(answers.pages_of(owner))))
    if kind == "register":  # the base only: a fork is never indexed
        held = [p for p in range(NUM_PAGES) if answers.holders(p)]
        return lambda pool: pool.register(held[bits % len(held)], DIGESTS[n]) if held else None
    if kind == "grant":  # a sound one: some cached pages it does not hold, then new ones
        cached = [p for p in range(NUM_PAGES) if answers.digest_of(p) is not None]
        mine = set(answers.pages_of(owner))
        shared = tuple(p for i, p in enumerate(cached) if bits >> i & 1 and p not in mine)
        new = tuple([p for p in answers.free_page_ids() if p not in shared][:n])
        return lambda pool: pool.grant_pages_for([(owner, shared, new)])
    # any_grant: pages picked by the bits, the first n shared, the rest new; often refused
    picked = [p for p in range(NUM_PAGES) if bits >> p & 1]
    return lambda pool: pool.grant_pages_for([(owner, tuple(picked[:n]), tuple(picked[n:]))])


def run(call, pool):
    try:
        return call(pool)
    except (PageOwnershipError, ValueError) as error:
        return f"{type(error).__name__}: {error}"


def answers_of(pool) -> dict:
    """Everything a KV op may ask a pool. Pure."""
    chains = [DIGESTS[i:] for i in range(len(DIGESTS))] + [(d,) for d in DIGESTS]
    return {
        "num_free": pool.num_free,
        "free_queue": list(pool.free_page_ids()),
        "tables": {owner: pool.pages_of(owner) for owner in OWNERS},
        "holders": [pool.holders(p) for p in range(NUM_PAGES)],
        "free": [pool.is_free(p) for p in range(NUM_PAGES)],
        "digests": [pool.digest_of(p) for p in range(NUM_PAGES)],
        "shared": pool.shared_pages(),
        "cached": [pool.cached_prefix(chain) for chain in chains],
    }


@settings(max_examples=60, deadline=None)
@given(history=OPS, ops=OPS.map(lambda ops: [op for op in ops if op[0] != "register"]))
def test_a_fork_answers_every_query_as_a_copy_of_its_base_after_the_same_ops(history, ops):
    base = cached_pool(NUM_PAGES)
    for op in history:
        run(op_call(op, base), base)
    base.check_integrity()
    twin, fork = copy.deepcopy(base), ForkedPagePool(base)
    for op in ops:
        call = op_call(op, twin)
        assert run(call, fork) == run(call, twin), op
        assert answers_of(fork) == answers_of(twin), op
    twin.check_integrity()


# ---- integrity -----------------------------------------------------------------------------------
def shared_pool() -> PagePool:
    """``cached_pool()`` with c sharing 0 and 4 and taking 6: page 0 and 4 held twice."""
    pool = cached_pool()
    pool.grant_pages_for([("c", (0, 4), (6,))])
    pool.check_integrity()
    return pool


def test_integrity_catches_a_shared_pages_holder_count_that_is_not_its_tables():
    pool = shared_pool()
    pool._holders[4] = 1  # corrupt: b and c both name it
    with pytest.raises(AssertionError, match=r"^gpu: a page's holder count is not its tables'"):
        pool.check_integrity()


def test_integrity_catches_a_digest_index_that_is_not_one_to_one():
    pool = shared_pool()
    pool._page_of["d9"] = 0  # corrupt: page 0 under d0 and d9
    with pytest.raises(AssertionError, match=r"^gpu: the digest index is not one-to-one"):
        pool.check_integrity()


def test_integrity_catches_a_shared_cache_entry_left_in_the_free_queue():
    pool = shared_pool()
    pool._free[0] = None  # corrupt: held by c, still queued
    with pytest.raises(AssertionError, match=r"^gpu: the free queue is not the unheld pages"):
        pool.check_integrity()


def test_integrity_catches_a_shared_set_that_is_not_the_pages_held_twice():
    pool = shared_pool()
    pool._shared.discard(4)
    with pytest.raises(AssertionError, match=r"^gpu: the shared set is not the pages held twice"):
        pool.check_integrity()
