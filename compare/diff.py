"""Compare two canonical forms: equal or not, which leaf paths differ, and why.

Equality is decided on the canonical forms (`==` first, then flattened leaf by leaf, then, when
the leaves agree, structurally: flattened paths are not unique); deepdiff
only explains a difference that is already known, and only over the differing leaves, so its
cost is O(what differs), not O(state).

Ignore globs match flattened paths and everything beneath them: `*` matches any run of characters
(dots and brackets included) and `?` one character; brackets are literal, so `requests[*].last_seen`
reads as written, and `stats` (or `stats.*`) drops everything under `stats`, keys added or removed
there included.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deepdiff import DeepDiff

from compare.canonical import flatten, list_item, same_leaf, shape_difference

# leaves explained in `Diff.detail` (each list's first items, then its later ones); the rest are
# only counted
MAX_DETAIL_PATHS = 50


@dataclass(frozen=True, slots=True)
class Diff:
    """The outcome of comparing an expected and an actual canonical form."""

    equal: bool
    paths: tuple[str, ...] = ()  # sorted flattened paths that differ or exist on one side only
    detail: dict = field(default_factory=dict)  # JSON-safe deepdiff explanation; {} when equal


def diff(expected: Any, actual: Any, *, ignore: Sequence[str] = ()) -> Diff:
    """Compare two canonical forms, dropping differences at paths that match an `ignore` glob."""
    if expected == actual:
        return Diff(equal=True)
    # mapping kinds named as expected's
    left, right = flatten(expected), flatten(actual, like=expected)
    paths = [
        path
        for path in sorted(left.keys() | right.keys())
        if path not in left or path not in right or not same_leaf(left[path], right[path])
    ]
    emptied = _emptied(
        [path for path in paths if path not in left or path not in right], left, right
    )
    if emptied:
        paths = [path for path in paths if path not in emptied]
    skip = (
        re.compile("|".join(_glob_to_regex(glob) for glob in ignore)).fullmatch if ignore else None
    )
    if skip is not None:
        paths = [path for path in paths if not skip(path)]
    shape = None
    # the leaves agree: only NaNs (or ignored paths) differ, or a shape flattened paths cannot show
    if not paths:
        shape = shape_difference(expected, actual, skip=skip)
        if shape is None:
            return Diff(equal=True)
        paths = [shape]
    detail = _explain(left, right, paths)
    if shape is not None:
        detail["shape"] = (
            f"the forms differ in structure at {shape} (a container's kind, keys or length)"
        )
    return Diff(equal=False, paths=tuple(paths), detail=detail)


def _emptied(one_sided: list[str], left: dict[str, Any], right: dict[str, Any]) -> set[str]:
    """Of the paths present on one side only, those that are an empty container there while the
    other side has leaves beneath them: those leaves name the difference (and ignore globs apply to
    them), so the container's own path does not. O(paths)."""
    emptied: set[str] = set()
    for here, there in ((left, right), (right, left)):
        empty = {path for path in one_sided if path in here and here[path] in ({}, [])}
        if empty:
            emptied |= empty & _parents(there)
    return emptied


def _parents(flat: dict[str, Any]) -> set[str]:
    """Every container path above a leaf path of ``flat`` (`a`, `a.b` and `a.b[0]` for `a.b[0].c`;
    `""` for the root)."""
    out = {""}
    for path in flat:
        out.update(path[:i] for i, char in enumerate(path) if char in ".[" and i)
    return out


def _glob_to_regex(glob: str) -> str:
    """A glob matches its path and everything beneath it (`stats` drops `stats.evictions` too)."""
    return "(?:" + re.escape(glob).replace(r"\*", ".*").replace(r"\?", ".") + r")(?:[.\[].*)?"


def _explain(left: dict[str, Any], right: dict[str, Any], paths: list[str]) -> dict:
    """Run deepdiff over the differing leaves only and return its report as plain JSON data: one
    entry per leaf (``threshold_to_diff_deeper=0``: never one whole-root entry of both dicts)."""
    shown = _detail_paths(paths)
    report = DeepDiff(
        {p: left[p] for p in shown if p in left},
        {p: right[p] for p in shown if p in right},
        verbose_level=2,
        threshold_to_diff_deeper=0,
    )
    try:
        detail = json.loads(report.to_json())
    # a leaf JSON cannot hold (a date, a complex): shown by its repr
    except (TypeError, ValueError):
        detail = json.loads(report.to_json(default_mapping={object: repr}))
    if len(paths) > len(shown):
        detail["omitted_paths"] = len(paths) - len(shown)
    return detail


def _detail_paths(paths: list[str]) -> list[str]:
    """The ``MAX_DETAIL_PATHS`` of ``paths`` the detail explains: paths not in a list first, then
    every list's first differing item, then every list's second, and so on. Pure."""
    indices: dict[str, list[int]] = {}
    for path in paths:
        item = list_item(path)
        if item is not None:
            indices.setdefault(item[0], []).append(item[1])
    ranks = {
        f"{parent}[{index}]": rank
        for parent, found in indices.items()
        for rank, index in enumerate(sorted(found), 1)
    }
    return sorted(paths, key=lambda path: ranks.get(path, 0))[:MAX_DETAIL_PATHS]
