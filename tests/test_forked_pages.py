"""ForkedPagePool: the ids its base would hand out, the base untouched, refused once the base
changed."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_dumps import pool_dump
from test_page_pool import pool_with_history

from batchgen.kv.page_grants import PageOwnershipError
from batchgen.kv.page_pool import PagePool
from batchgen.shadow.forked_pages import ForkedPagePool


def test_fork_hands_out_the_ids_the_base_would_and_leaves_the_base_untouched():
    base = pool_with_history()
    twin = copy.deepcopy(base)
    before = pool_dump(base)
    fork = ForkedPagePool(base)
    for pool in (fork, twin):
        assert pool.allocate_pages("c", 2) == [5, 6]
        pool.release_pages("b")
        assert pool.allocate_pages("d", 5) == [7, 0, 1, 2, 3]
        pool.take_pages("e", [4])
        assert pool.num_free == 0
        assert (pool.pages_of("b"), pool.pages_of("c"), pool.pages_of("d")) == (
            (),
            (5, 6),
            (7, 0, 1, 2, 3),
        )
    assert pool_dump(base) == before


def test_fork_take_rejects_pages_it_does_not_have_free():
    fork = ForkedPagePool(pool_with_history())
    fork.allocate_pages("c", 1)
    with pytest.raises(PageOwnershipError, match=r"^gpu: page 5 is not free$"):
        fork.take_pages("d", [5])
    with pytest.raises(PageOwnershipError, match=r"^gpu: page 3 is not free$"):
        fork.take_pages("d", [3])


def test_fork_raises_once_its_base_changed():
    base = pool_with_history()
    fork = ForkedPagePool(base)
    base.allocate_pages("c", 1)
    with pytest.raises(RuntimeError, match=r"^gpu: fork used after its base pool changed$"):
        fork.allocate_pages("d", 1)
    with pytest.raises(RuntimeError, match="fork used after its base pool changed"):
        _ = fork.num_free


@pytest.mark.parametrize(
    "access",
    [
        lambda fork: fork.release_pages("a"),
        lambda fork: fork.pages_of("a"),
        lambda fork: fork.is_free(0),
        lambda fork: fork.peek_free_pages(1),
    ],
    ids=["release_pages", "pages_of", "is_free", "peek_free_pages"],
)
def test_a_fork_refuses_every_access_once_its_base_changed(access):
    base = PagePool("gpu", 4)
    base.allocate_pages("a", 2)
    fork = ForkedPagePool(base)
    base.release_pages("a")
    with pytest.raises(RuntimeError, match=r"^gpu: fork used after its base pool changed$"):
        access(fork)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "release", "take", "take_for"]),
        st.sampled_from("abcd"),
        st.integers(0, 5),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(history=OPS, ops=OPS)
def test_fork_matches_a_copy_of_the_base_for_any_op_sequence(history, ops):
    base = PagePool("gpu", 12)
    apply_ops(base, history)
    before = pool_dump(base)
    twin, fork = copy.deepcopy(base), ForkedPagePool(base)
    assert apply_ops(fork, ops) == apply_ops(twin, ops)
    assert pool_dump(base) == before
    assert fork.num_free == twin.num_free
    assert all(fork.pages_of(uuid) == twin.pages_of(uuid) for uuid in "abcd")


def apply_ops(pool, ops) -> list:
    """Apply (op, uuid, n) triples that fit; returns what each op gave. Mutates ``pool``."""
    results = []
    for op, uuid, n in ops:
        if op == "alloc" and n <= pool.num_free:
            results.append(pool.allocate_pages(uuid, n))
        elif op == "release":
            results.append(pool.release_pages(uuid))
        elif op == "take" and n <= pool.num_free:
            page_ids = pool.peek_free_pages(n)[::-1]  # out of queue order
            pool.take_pages(uuid, page_ids)
            results.append(page_ids)
        # two grants at once: uuid, then the next owner
        elif op == "take_for" and n <= pool.num_free:
            page_ids = pool.peek_free_pages(n)[::-1]
            grants = [
                (uuid, page_ids[: n // 2]),
                ("abcd"[("abcd".index(uuid) + 1) % 4], page_ids[n // 2 :]),
            ]
            pool.take_pages_for(grants)
            results.append(grants)
    return results
