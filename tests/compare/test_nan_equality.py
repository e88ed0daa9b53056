"""NaN in canonical equality: NaN equals NaN (two paths computing the same NaN agree) and differs
from every other value, a number above all, at a leaf, deep in a form, and in the executor."""

import math

import pytest

from compare.canonical import Keyed, same_leaf, shape_difference
from compare.diff import diff
from compare.shadow import ShadowExecutor

NAN = float("nan")
OTHERS = [0.0, 1.0, -1.5, math.inf, -math.inf, 0, None, "nan", True]


def test_nan_equals_nan_and_differs_from_any_number_in_canonical_equality():
    assert same_leaf(NAN, float("nan"))
    for value in OTHERS:
        assert (same_leaf(NAN, value), same_leaf(value, NAN)) == (False, False), value


@pytest.mark.parametrize("value", OTHERS, ids=repr)
def test_a_nan_against_a_number_is_a_difference_at_its_path_on_either_side(value):
    expected = {"requests": Keyed({"r1": {"logprobs": [0.5, NAN]}})}
    actual = {"requests": Keyed({"r1": {"logprobs": [0.5, value]}})}
    for left, right in ((expected, actual), (actual, expected)):
        result = diff(left, right)
        assert (result.equal, result.paths) == (False, ("requests[r1].logprobs[1]",))
        assert shape_difference(left, right) == "requests[r1].logprobs[1]"


def test_nans_in_both_forms_are_equal_while_a_number_beside_them_still_differs():
    assert diff({"a": [NAN, 1.0]}, {"a": [float("nan"), 1.0]}).equal
    assert diff({"a": [NAN, 1.0]}, {"a": [float("nan"), 2.0]}).paths == ("a[1]",)


def test_the_executor_reports_a_nan_against_a_number_as_a_divergence():
    divergences = []
    executor = ShadowExecutor(
        mode="log",
        on_divergence=lambda *report: divergences.append(report),
        on_harness_error=lambda *error: pytest.fail(f"harness error {error}"),
    )
    for auth, shadow in (({"x": [NAN]}, {"x": [0.0]}), ({"x": [0.0]}, {"x": [NAN]})):
        executor.run_both(
            "alloc",
            0,
            authoritative=lambda: "result",
            shadow=lambda forked, shadow=shadow: shadow,
            shadow_path="legacy",
            authoritative_path="plan",
            canonicalize=lambda seen, other, auth=auth: (auth, other.value),
        )
    assert len(divergences) == 2
    assert executor.stats().num_compared == {"alloc": 2}
