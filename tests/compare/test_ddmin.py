import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compare.minimize import ddmin


def needs(*required):
    """A failure that happens whenever every `required` item is present."""
    return lambda items: set(required) <= set(items)


def test_finds_the_known_minimal_subset():
    assert ddmin(list(range(40)), needs(3, 17, 31)) == [3, 17, 31]


def test_keeps_the_original_order():
    assert ddmin(["evict", "alloc", "poll", "migrate", "release"], needs("migrate", "alloc")) == [
        "alloc",
        "migrate",
    ]


def test_shrinks_to_a_single_item():
    assert ddmin(list(range(100)), needs(64)) == [64]


def test_finds_an_order_dependent_failure():
    def alloc_after_release(items):
        return "release" in items and "alloc" in items[items.index("release") :]

    ops = ["poll", "alloc", "release", "evict", "migrate", "alloc", "poll"]
    assert ddmin(ops, alloc_after_release) == ["release", "alloc"]


def test_refuses_an_input_that_does_not_fail():
    with pytest.raises(ValueError, match="still_fails"):
        ddmin([1, 2, 3], needs(4))


def test_tests_each_subsequence_at_most_once():
    seen = []

    def still_fails(items):
        seen.append(tuple(items))
        return {2, 9} <= set(items)

    ddmin(list(range(16)), still_fails)
    assert len(seen) == len(set(seen))


def test_stops_at_the_test_budget_with_a_warning_and_the_smallest_failure_so_far():
    calls = []

    def still_fails(items):
        calls.append(len(items))
        return {0, 63} <= set(items)

    with pytest.warns(UserWarning, match="stopped after 12 tests; the result of 32 items"):
        result = ddmin(list(range(64)), still_fails, max_tests=12)
    # the input, halves, quarters, two quarter complements, a 3-chunk complement, two eighths
    assert calls == [64, 32, 32, 16, 16, 16, 16, 48, 48, 32, 8, 8]
    assert result == [*range(16), *range(48, 64)]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 30).flatmap(
        lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), min_size=1, max_size=4))
    )
)
def test_returns_a_one_minimal_subsequence(case):
    n, required = case
    result = ddmin(list(range(n)), needs(*required))
    assert result == sorted(required)


def test_drops_the_last_item_when_the_empty_input_still_fails():
    assert ddmin([1, 2, 3], lambda subset: True) == []


def test_refuses_a_budget_that_cannot_test_the_input():
    with pytest.raises(ValueError, match="max_tests must be >= 1"):
        ddmin([1, 2], lambda subset: True, max_tests=0)


def test_repeated_items_are_tested_once_per_distinct_subsequence():
    calls = []

    def at_least_three_units(subset):
        calls.append(tuple(subset))
        return subset.count("unit") >= 3

    assert ddmin(["unit"] * 40, at_least_three_units, interchangeable=True) == ["unit"] * 3
    assert len(calls) == len(set(calls))  # never the same subsequence twice
    assert len(calls) <= 40


def test_equal_items_are_told_apart_unless_declared_interchangeable():
    assert ddmin([1, 1.0], lambda subset: any(type(item) is float for item in subset)) == [1.0]
