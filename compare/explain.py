"""A divergence in rows a person reads: each differing field path with each side's value under its
path's name, long values cut, runs of consecutive list indices collapsed into one row.

    pools.gpu[0].page_ids[0..1]  plan: [4, 3]  legacy: [0, 1]
    requests[r7].phase  plan: "running"  legacy: (absent)

The values come from `compare.diff`'s explanation (deepdiff over the differing leaves: one entry
per flattened path, or one whole-root entry holding both dicts, as deepdiff writes it under its
default ``threshold_to_diff_deeper``), live or as a record logged it, or from two canonical forms.
Rows are plain text: every renderer escapes them for its format (logs are anyone's input).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compare.canonical import list_item
from compare.diff import diff
from compare.records import DivergenceRecord

MAX_VALUE_CHARS = 60  # a value's text is cut after this many characters
MAX_ITEMS = 8  # values shown of a collapsed run
ABSENT_TEXT = "(absent)"
# what deepdiff puts before each quote of a key that holds both kinds of quote
_QUOTE_MARK = "\U0001d1ba\U0001d165\U0001d16f"


class _Absent:
    """The value of a path on the side that does not have it."""

    def __repr__(self) -> str:
        return ABSENT_TEXT


ABSENT = _Absent()


@dataclass(frozen=True, slots=True)
class Row:
    """One field path (or a run of consecutive indices) and each side's value, as text."""

    path: str  # e.g. "pools.gpu[0].page_ids[0..1]"
    values: tuple[tuple[str, str], ...]  # (path name, value), authoritative first; () unrecorded

    @property
    def text(self) -> str:
        """``path  plan: [4, 3]  legacy: [0, 1]``. Pure."""
        return "  ".join([self.path, *(f"{name}: {value}" for name, value in self.values)])


def explain_record(record: DivergenceRecord, paths: Collection[str] | None = None) -> list[Row]:
    """The rows of a logged divergence (those of ``paths`` only, when given); a divergence
    without field paths (an exception) is one row, its exception text. Pure."""
    if not record.field_paths:
        return [Row(record.exception or f"<{record.kind}>", ())]
    wanted = record.field_paths
    if paths is not None:
        kept = set(paths)
        wanted = [path for path in wanted if path in kept]
    return explain(record.diff, wanted, record.authoritative, record.shadow)


def explain_forms(authoritative_form: Any, shadow_form: Any, names: tuple[str, str]) -> list[Row]:
    """The rows of two canonical forms, named ``names`` (authoritative, shadow). Pure."""
    found = diff(authoritative_form, shadow_form)
    return explain(found.detail, found.paths, *names)


def explain(detail: Mapping, paths: Sequence[str], authoritative: str, shadow: str) -> list[Row]:
    """A row per field path of ``paths`` (runs of consecutive indices collapsed), each side's
    value from ``detail`` (``compare.diff``'s explanation) under its path's name; a path the
    detail does not hold (past its bound, a data check's) is a row without values. Pure."""
    labels = (authoritative, f"{shadow} (shadow)" if shadow == authoritative else shadow)
    values = leaf_values(detail)
    return [_row(run, values, labels) for run in _runs(list(paths), values)]


def row_lines(rows: Sequence[Row], limit: int) -> list[str]:
    """The first ``limit`` rows' texts, then ``(+N more)`` for the rest. Pure."""
    lines = [row.text for row in rows[:limit]]
    return lines + [f"(+{len(rows) - limit} more)"] if len(rows) > limit else lines


def leaf_values(detail: Mapping) -> dict[str, tuple[Any, Any]]:
    """{flattened path: (authoritative value, shadow value)} from a diff's explanation, ``ABSENT``
    for the side without the path; entries of any other shape are left out. Pure."""
    found: dict[str, tuple[Any, Any]] = {}
    for kind in ("values_changed", "type_changes"):
        for key, change in _entries(detail, kind):
            if isinstance(change, Mapping) and key == "root":
                found.update(_whole_root(change.get("old_value"), change.get("new_value")))
            elif isinstance(change, Mapping):
                old, new = change.get("old_value", ABSENT), change.get("new_value", ABSENT)
                found[_leaf_path(key)] = (old, new)
    for key, value in _entries(detail, "dictionary_item_removed"):
        found[_leaf_path(key)] = (value, ABSENT)
    for key, value in _entries(detail, "dictionary_item_added"):
        found[_leaf_path(key)] = (ABSENT, value)
    return found


def _entries(detail: Mapping, kind: str) -> Iterable[tuple[str, Any]]:
    """The (deepdiff key, entry) pairs of one kind of change in ``detail``. Pure."""
    entries = detail.get(kind) if isinstance(detail, Mapping) else None
    return [(k, v) for k, v in entries.items() if isinstance(k, str)] if entries else []


def _whole_root(old: Any, new: Any) -> dict[str, tuple[Any, Any]]:
    """The leaves of deepdiff's whole-root entry: the two flattened dicts it holds. Pure."""
    old, new = (side if isinstance(side, Mapping) else {} for side in (old, new))
    return {path: (old.get(path, ABSENT), new.get(path, ABSENT)) for path in {*old, *new}}


def _leaf_path(key: str) -> str:
    """The flattened path deepdiff wrote as ``root['<path>']`` (``root["..."]`` when it holds a
    single quote, each quote marked when it holds both kinds). Pure."""
    if not (key.startswith("root[") and key.endswith("]")):
        return key
    inner = key[5:-1]
    if len(inner) >= 2 and inner[0] == inner[-1] and inner[0] in "'\"":
        inner = inner[1:-1]
    return inner.replace(_QUOTE_MARK, "")


def _runs(paths: list[str], values: Mapping[str, tuple]) -> list[list[str]]:
    """``paths`` grouped into rows, in order of first appearance: a path alone, or a run of a list's
    consecutive indices whose sides hold them alike (indices past the recorded ones join the run
    they follow). Pure."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for path in paths:
        item = list_item(path)
        groups.setdefault(path if item is None else item[0], []).append(
            (0, path) if item is None else (item[1], path)
        )
    runs: list[list[str]] = []
    for members in groups.values():
        previous, shape = None, None
        for index, path in sorted(members):
            pair = values.get(path)
            joins = pair is None or _presence(pair) == shape
            if previous is not None and previous == index - 1 and joins:
                runs[-1].append(path)
            else:
                runs.append([path])
                shape = _presence(pair)
            previous = index
    return runs


def _presence(pair: tuple | None) -> tuple[bool, bool] | None:
    """Which sides lack a path's value; None for a path without recorded values. Pure."""
    return None if pair is None else (pair[0] is ABSENT, pair[1] is ABSENT)


def _row(run: list[str], values: Mapping, labels: tuple[str, str]) -> Row:
    """The row of one path, or of a run of indices, each side's values as a list. Pure."""
    pairs = [values[path] for path in run if path in values]
    path = run[0]
    if len(run) > 1:
        parent, first = list_item(run[0])
        path = f"{parent}[{first}..{list_item(run[-1])[1]}]"
    if not pairs:
        return Row(path, ())
    if len(run) == 1:
        return Row(path, tuple(zip(labels, map(_value_text, pairs[0]))))
    sides = [[pair[side] for pair in pairs] for side in (0, 1)]
    texts = [ABSENT_TEXT if side[0] is ABSENT else _list_text(side, len(run)) for side in sides]
    return Row(path, tuple(zip(labels, texts)))


def _list_text(items: list, total: int) -> str:
    """``[4, 3]``: the first ``MAX_ITEMS`` of a run's ``total`` values, then ``... (+N more)``
    for the rest, shown or not recorded. Pure."""
    shown = [_value_text(item) for item in items[:MAX_ITEMS]]
    if total > len(shown):
        shown.append(f"... (+{total - len(shown)} more)")
    return f"[{', '.join(shown)}]"


def _value_text(value: Any) -> str:
    """One value as JSON (``"running"``, ``null``, ``12``), cut after ``MAX_VALUE_CHARS``
    characters with ``... (+N more chars)``; ``(absent)`` for ``ABSENT``. Pure."""
    if value is ABSENT:
        return ABSENT_TEXT
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) <= MAX_VALUE_CHARS:
        return text
    return f"{text[:MAX_VALUE_CHARS]}... (+{len(text) - MAX_VALUE_CHARS} more chars)"
