"""PagePool: FIFO ids, exact-id takes, errors, integrity."""

import re

import pytest
from kv_dumps import pool_dump

from batchgen.kv.page_grants import OutOfPages, PageOwnershipError
from batchgen.kv.page_pool import PagePool
from batchgen.shadow.forked_pages import ForkedPagePool


def pool_with_history() -> PagePool:
    """8 pages; 'a' holds 0-2 then releases them, 'b' holds 3-4: free queue [5, 6, 7, 0, 1, 2]."""
    pool = PagePool("gpu", 8)
    pool.allocate_pages("a", 3)
    pool.allocate_pages("b", 2)
    pool.release_pages("a")
    return pool


# ---- FIFO order ------------------------------------------------------------------------------
def test_allocation_takes_ids_from_the_queue_head_in_order():
    pool = PagePool("gpu", 6)
    assert pool.allocate_pages("a", 2) == [0, 1]
    assert pool.allocate_pages("b", 3) == [2, 3, 4]
    assert pool.pages_of("a") == (0, 1)
    assert pool.num_free == 1


def test_released_pages_join_the_tail_and_are_reused_in_release_order():
    pool = pool_with_history()
    assert pool.peek_free_pages(6) == [5, 6, 7, 0, 1, 2]
    assert pool.allocate_pages("c", 4) == [5, 6, 7, 0]
    pool.release_pages("b")
    assert pool.allocate_pages("d", 4) == [1, 2, 3, 4]


def test_an_owner_growing_keeps_its_page_table_order():
    pool = PagePool("gpu", 6)
    pool.allocate_pages("a", 2)
    pool.allocate_pages("b", 1)
    pool.allocate_pages("a", 2)
    assert pool.pages_of("a") == (0, 1, 3, 4)
    assert pool.release_pages("a") == [0, 1, 3, 4]
    assert pool.peek_free_pages(5) == [5, 0, 1, 3, 4]


def test_releasing_an_owner_without_pages_changes_nothing():
    pool = pool_with_history()
    before = pool_dump(pool)
    assert pool.release_pages("nobody") == []
    assert pool_dump(pool) == before


def test_peek_does_not_mutate():
    pool = pool_with_history()
    before = pool_dump(pool)
    assert pool.peek_free_pages(2) == [5, 6]
    assert pool_dump(pool) == before


# ---- take_pages ------------------------------------------------------------------------------
def test_take_of_the_queue_head_leaves_the_rest_of_the_queue_in_order():
    pool = pool_with_history()
    pool.take_pages("c", [5, 6])
    assert pool.pages_of("c") == (5, 6)
    assert pool.peek_free_pages(4) == [7, 0, 1, 2]


def test_take_out_of_queue_order_removes_exactly_those_ids():
    pool = pool_with_history()
    pool.take_pages("c", [1, 7])
    assert pool.pages_of("c") == (1, 7)
    assert pool.peek_free_pages(4) == [5, 6, 0, 2]
    pool.check_integrity()


def test_take_rejects_a_page_named_twice_and_changes_nothing():
    pool = pool_with_history()
    before = pool_dump(pool)
    with pytest.raises(PageOwnershipError, match=r"^gpu: page ids \[5, 5\] name a page twice$"):
        pool.take_pages("c", [5, 5])
    assert pool_dump(pool) == before


def test_take_for_refuses_a_single_grant_that_is_not_an_owner_and_ids_pair_and_changes_nothing():
    pool = pool_with_history()
    before = pool_dump(pool)
    with pytest.raises(ValueError, match="too many values to unpack"):
        # the queue head's ids: the fast path would take them
        pool.take_pages_for([("c", [5, 6], "extra")])
    assert pool_dump(pool) == before


def test_take_rejects_an_out_of_range_page_and_changes_nothing():
    pool = pool_with_history()
    before = pool_dump(pool)
    with pytest.raises(PageOwnershipError, match=r"^gpu: page 8 is out of range \[0, 8\)$"):
        pool.take_pages("c", [5, 8])
    assert pool_dump(pool) == before


def test_take_rejects_an_owned_page_and_changes_nothing():
    pool = pool_with_history()
    before = pool_dump(pool)
    with pytest.raises(PageOwnershipError, match=r"^gpu: page 3 is not free$"):
        pool.take_pages("c", [5, 3])
    assert pool_dump(pool) == before


def test_take_for_several_owners_names_the_refused_grant_and_changes_nothing():
    pool = pool_with_history()
    before = pool_dump(pool)
    with pytest.raises(PageOwnershipError, match=r"^gpu: page 5 is granted twice$") as refused:
        pool.take_pages_for([("c", [5]), ("d", [6, 5])])
    assert (refused.value.index, refused.value.page_id) == (1, 5)
    with pytest.raises(PageOwnershipError, match=r"^gpu: page 3 is not free$") as refused:
        pool.take_pages_for([("c", [5]), ("d", []), ("e", [6, 3])])
    assert (refused.value.index, refused.value.page_id) == (2, 3)
    assert pool_dump(pool) == before


@pytest.mark.parametrize("bad_id", [True, 1.0, [1]], ids=["bool", "float", "list"])
@pytest.mark.parametrize("forked", [False, True], ids=["pool", "fork"])
def test_take_for_refuses_a_page_id_that_is_not_an_int_even_when_its_page_is_free(bad_id, forked):
    base = PagePool("gpu", 4)
    pool = ForkedPagePool(base) if forked else base
    before = pool_dump(base)
    with pytest.raises(
        PageOwnershipError, match=rf"^gpu: page id {re.escape(repr(bad_id))} is not an int$"
    ) as refused:
        pool.take_pages_for([("a", [0]), ("b", [2, bad_id])])
    assert refused.value.index == 1
    assert pool.peek_free_pages(4) == [0, 1, 2, 3] and pool_dump(base) == before


def test_take_for_several_owners_takes_them_in_order_and_skips_an_owner_given_none():
    pool = pool_with_history()
    pool.take_pages_for([("c", [6]), ("d", []), ("e", [5, 7])])
    assert (pool.pages_of("c"), pool.pages_of("d"), pool.pages_of("e")) == ((6,), (), (5, 7))
    assert pool.peek_free_pages(3) == [0, 1, 2]
    pool.check_integrity()


@pytest.mark.parametrize("grants", [[], [("c", [])], [("c", []), ("d", ())]])
def test_take_for_granting_no_page_changes_nothing_and_keeps_forks_valid(grants):
    pool = pool_with_history()
    fork = ForkedPagePool(pool)
    before = pool_dump(pool)
    pool.take_pages_for(grants)
    assert pool_dump(pool) == before
    assert fork.allocate_pages("c", 1) == [5]  # a fork refuses every access once its base changed


# ---- errors ----------------------------------------------------------------------------------
def test_allocating_more_than_free_raises_out_of_pages_and_changes_nothing():
    pool = pool_with_history()
    before = pool_dump(pool)
    with pytest.raises(OutOfPages, match=r"^gpu: 7 pages requested, 6 free$"):
        pool.allocate_pages("c", 7)
    assert pool_dump(pool) == before
    assert pool.num_free == 6


def test_allocating_a_negative_count_is_rejected():
    with pytest.raises(ValueError, match=r"^gpu: cannot allocate -1 pages$"):
        PagePool("gpu", 4).allocate_pages("a", -1)


def test_a_negative_pool_size_is_rejected():
    with pytest.raises(ValueError, match=r"^host: num_pages must be >= 0, got -1$"):
        PagePool("host", -1)


# ---- integrity -------------------------------------------------------------------------------
def test_integrity_holds_for_a_used_pool():
    pool = pool_with_history()
    pool.check_integrity(live_uuids={"b"})


def test_integrity_catches_a_page_both_free_and_owned():
    pool = pool_with_history()
    pool._free[3] = None  # corrupt: 3 is owned by "b"
    with pytest.raises(AssertionError, match="gpu: the free queue is not the unheld pages"):
        pool.check_integrity()


def test_integrity_catches_a_holder_count_that_is_not_the_tables():
    pool = pool_with_history()
    pool._holders[3] = 0  # corrupt: 3 is owned by "b"
    with pytest.raises(AssertionError, match="gpu: a page's holder count is not its tables'"):
        pool.check_integrity()


def test_integrity_catches_a_lost_page():
    pool = pool_with_history()
    lost = pool._owned["b"].pop()  # corrupt: the page is neither free nor in a table
    pool._holders[lost] = 0
    with pytest.raises(AssertionError, match="gpu: the free queue is not the unheld pages"):
        pool.check_integrity()


def test_integrity_catches_pages_of_an_owner_no_longer_live():
    pool = pool_with_history()
    with pytest.raises(
        AssertionError, match=r"gpu: pages owned by requests no longer live: \['b'\]"
    ):
        pool.check_integrity(live_uuids=set())
