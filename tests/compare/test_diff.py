import importlib
import json
from datetime import date

import pytest

from compare.canonical import Keyed
from compare.diff import MAX_DETAIL_PATHS, Diff, diff

# `compare.diff` names the function on the package; the module is reached through sys.modules.
diff_module = importlib.import_module("compare.diff")


def _state(**pages):
    return {
        "requests": Keyed({rid: {"gpu_pages": list(p)} for rid, p in pages.items()}),
        "stats": {"num_steps": 1},
    }


def _forbid(name):
    def forbidden(*args, **kwargs):
        raise AssertionError(f"{name} must not run")

    return forbidden


def test_takes_the_fast_path_for_equal_forms_without_flattening_or_deepdiff(monkeypatch):
    monkeypatch.setattr(diff_module, "flatten", _forbid("flatten"))
    monkeypatch.setattr(diff_module, "DeepDiff", _forbid("DeepDiff"))
    assert diff(_state(r1=[1, 2]), _state(r1=[1, 2])) == Diff(equal=True, paths=(), detail={})


def test_lists_changed_added_and_removed_leaf_paths_sorted():
    result = diff(_state(r1=[1, 2], r2=[5]), _state(r1=[1, 3, 4], r3=[6]))
    assert not result.equal
    assert result.paths == (
        "requests[r1].gpu_pages[1]",
        "requests[r1].gpu_pages[2]",
        "requests[r2].gpu_pages[0]",
        "requests[r3].gpu_pages[0]",
    )


def test_explains_a_difference_with_json_safe_deepdiff_detail():
    result = diff({"phase": "RUNNING", "pages": [1]}, {"phase": "SWAPPED", "pages": []})
    assert json.loads(json.dumps(result.detail)) == result.detail
    assert result.detail["values_changed"]["root['phase']"] == {
        "old_value": "RUNNING",
        "new_value": "SWAPPED",
    }
    assert result.detail["dictionary_item_removed"] == {"root['pages[0]']": 1}
    assert result.paths == ("pages[0]", "phase")  # the emptied list is named by the item it lost


def test_runs_deepdiff_over_the_differing_leaves_only(monkeypatch):
    seen = []

    class RecordingDeepDiff:
        def __init__(self, left, right, **kwargs):
            seen.append((left, right))

        def to_json(self):
            return "{}"

    monkeypatch.setattr(diff_module, "DeepDiff", RecordingDeepDiff)
    diff(_state(r1=[1, 2], r2=[7]), _state(r1=[1, 3], r2=[7]))
    assert seen == [({"requests[r1].gpu_pages[1]": 2}, {"requests[r1].gpu_pages[1]": 3})]


def test_drops_differences_at_paths_matching_an_ignore_glob():
    expected, actual = _state(r1=[1]), _state(r1=[2])
    actual["stats"] = {"num_steps": 2}
    assert diff(expected, actual, ignore=["stats.*"]).paths == ("requests[r1].gpu_pages[0]",)


def test_reads_brackets_in_ignore_globs_literally():
    result = diff(
        _state(r1=[1], r2=[2]), _state(r1=[9], r2=[8]), ignore=["requests[*].gpu_pages[0]"]
    )
    assert result == Diff(equal=True)


def test_is_equal_without_running_deepdiff_when_every_difference_is_ignored(monkeypatch):
    monkeypatch.setattr(diff_module, "DeepDiff", _forbid("DeepDiff"))
    assert diff({"t": 1.0}, {"t": 2.0}, ignore=["t"]).equal


def test_treats_nan_as_equal_to_nan():
    assert diff({"loss": float("nan")}, {"loss": float("nan")}).equal


def test_tells_an_empty_list_from_an_absent_field():
    assert diff({"pages": [], "n": 1}, {"n": 1}).paths == ("pages",)


@pytest.mark.parametrize("extra", [1, 25])
def test_bounds_the_detail_and_counts_the_omitted_paths(extra):
    num = MAX_DETAIL_PATHS + extra
    result = diff({"pages": list(range(num))}, {"pages": [-1] * num})
    assert len(result.paths) == num
    assert len(result.detail["values_changed"]) == MAX_DETAIL_PATHS
    assert result.detail["omitted_paths"] == extra


@pytest.mark.parametrize(
    ("expected", "actual", "path"),
    [
        (
            {"a.b": 1},
            {"a": {"b": 1}},
            "<root>",
        ),  # a dotted key and nesting flatten to the same path
        (Keyed({"0": 5}), [5], "<root>"),  # an id "0" and list index 0 both render [0]
        ({"x": [1, 2]}, {"x": Keyed({"0": 1, "1": 2})}, "x"),
        (
            {"r": Keyed({"a": {"n": [1, {"b": 2}]}})},
            {"r": Keyed({"a": {"n": [1, {"b.c": 2}]}})},
            # differs in a leaf path too: reported as those leaves, no shape
            ("r[a].n[1].b", "r[a].n[1].b.c"),
        ),
    ],
)
def test_reports_forms_that_differ_only_where_flattened_paths_collide(expected, actual, path):
    outcome = diff(expected, actual)
    assert not outcome.equal
    if isinstance(path, tuple):
        assert outcome.paths == path
        assert "shape" not in outcome.detail
    else:
        assert outcome.paths == (path,)
        assert "structure" in outcome.detail["shape"]


@pytest.mark.parametrize(
    ("expected", "actual", "ignore", "path"),
    [
        # the ignored leaf hid the shape
        ({"t": 1, "a.b": 1}, {"t": 2, "a": {"b": 1}}, ["t"], "<root>"),
        (
            {"a": {"x.y": 1}, "z": {"p.q": 2}},
            {"a": {"x": {"y": 1}}, "z": {"p": {"q": 2}}},
            ["a*"],
            "z",
        ),
    ],
)
def test_an_ignored_difference_does_not_hide_a_shape_difference_elsewhere(
    expected, actual, ignore, path
):
    assert diff(expected, actual, ignore=ignore).paths == (path,)


def test_ignores_a_shape_difference_under_an_ignored_path():
    assert diff({"a": {"x.y": 1}, "t": 1}, {"a": {"x": {"y": 1}}, "t": 2}, ignore=["a*", "t"]).equal


def test_a_keyed_and_a_plain_dict_of_the_same_items_are_the_same_shape():
    nan = float("nan")  # two distinct NaN objects: == fails, the flattened leaves agree
    assert diff({"a": Keyed(), "n": nan}, {"a": {}, "n": float("nan")}).equal


def test_a_keyed_and_a_plain_dict_with_items_and_a_nan_are_equal():
    nan = float("nan")  # == fails on the NaN; the mapping kinds render different paths ([k] and .k)
    assert diff({"m": Keyed({"k": 1}), "n": nan}, {"m": {"k": 1}, "n": float("nan")}).equal


def test_a_keyed_against_a_plain_dict_names_only_the_leaf_that_differs():
    outcome = diff({"m": Keyed({"k": 1, "j": 2})}, {"m": {"k": 1, "j": 3}})
    assert outcome.paths == ("m[j]",)


@pytest.mark.parametrize(
    ("expected", "actual", "ignore"),
    [
        ({"stats": {"a": 1}}, {"stats": {"b": 1}}, ["stats.*"]),
        # a key added to an empty mapping, as to a full one
        ({"stats": {}}, {"stats": {"b": 1}}, ["stats.*"]),
        ({"m": Keyed({"a": 1})}, {"m": Keyed({"a": 1, "b": 2})}, ["m[*]"]),
        ({"m": Keyed()}, {"m": Keyed({"a": 1})}, ["m[*]"]),
        ({"m": [1]}, {"m": [1, 2]}, ["m[*]"]),  # a list item added, as a key
        # a glob covers what is beneath
        ({"stats": Keyed({"0": 1}), "n": 1}, {"stats": [1], "n": 1}, ["stats"]),
        ({"stats": Keyed({"0": 1})}, {"stats": Keyed({"0": 2})}, ["stats"]),
    ],
)
def test_an_ignore_glob_covers_everything_beneath_its_path(expected, actual, ignore):
    assert diff(expected, actual, ignore=ignore).equal


def test_an_ignore_glob_leaves_what_it_does_not_cover():
    assert diff({"m": [1], "n": {}}, {"m": [1, 2], "n": {"k": 1}}, ignore=["m[*]"]).paths == (
        "n.k",
    )
    assert diff({"m": [1, 5]}, {"m": [1]}, ignore=["m[0]"]).paths == ("m[1]",)


def test_explains_leaves_json_cannot_hold_by_their_repr():
    outcome = diff({"day": date(2024, 1, 1), "z": 1j}, {"day": date(2024, 1, 2), "z": 2j})
    assert outcome.paths == ("day", "z")
    assert outcome.detail["values_changed"]["root['day']"] == {
        "old_value": "datetime.date(2024, 1, 1)",
        "new_value": "datetime.date(2024, 1, 2)",
    }
    assert json.loads(json.dumps(outcome.detail)) == outcome.detail
