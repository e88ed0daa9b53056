"""Canonical forms: plain data that two paths' results can be compared on.

`canonicalize` turns the objects a path produces into nested dicts, lists and scalars, so that
two results are equal exactly when their canonical forms are `==`. `flatten` turns a canonical
form into `{leaf path: value}` so a difference can be named (`requests[r17].gpu_pages[3]`), and
`wildcard` folds ids and indexes out of a path so differences can be counted per field.

    object                          canonical form            path component
    dataclass / pydantic model      dict of fields            .field
    Mapping (ids -> values)         Keyed, str keys, sorted   [key]
    list / tuple                    list                      [index]
    set / frozenset                 sorted list               [index]
    Enum                            its name (a Flag of several: Type(value))
    None, bool, int, float, str     itself

Scalars compare as Python compares them (`True == 1 == 1.0`, `0.0 == -0.0`); a binding whose values
must also differ by type maps them apart in its canonicalize hook. Nothing here mutates its input.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

from pydantic import BaseModel

_SCALARS = (str, int, float, bool, type(None))
_EXACT_SCALARS = frozenset(_SCALARS)
# a `[key]` component; `\]` and `\\` inside it are the key's own
_BRACKETED = re.compile(r"\[(?:[^\]\\]|\\.)*\]")
_LIST_ITEM = re.compile(r"(.*)\[(\d+)\]", re.DOTALL)  # a path ending in a list index


class Keyed(dict):
    """A collection keyed by id (requests by id): its keys render as `[key]` in flattened paths.

    It compares equal to a plain dict with the same items; only path rendering differs.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Keyed({dict.__repr__(self)})"


class _Unsupported(Exception):
    """Raised inside `_canon`; collects the path to the offending value while unwinding."""

    def __init__(self, value: Any, reason: str) -> None:
        super().__init__(reason)
        self.value = value
        self.reason = reason
        self.parts: list[str] = []  # innermost first; each already rendered (".f", "[k]")


def canonicalize(obj: Any) -> Any:
    """Return the canonical form of `obj` (a new object; `obj` is not modified).

    Dataclasses (slotted and frozen too) and pydantic models become plain dicts of their fields
    (pydantic models field by field, shallowly, so nested models and mappings keep their kind);
    mappings become `Keyed` with str keys (enum keys by name) in sorted order; sets become sorted
    lists. Any other type raises TypeError naming the type and its path, e.g.
    `cannot canonicalize bytes at requests[r17].blob`. Pass objects, not canonical forms: a
    plain dict is a mapping here, so the field dicts of a canonical form would become `Keyed`.
    """
    try:
        return _canon(obj)
    except _Unsupported as error:
        path = "".join(reversed(error.parts)).lstrip(".") or "<root>"
        raise TypeError(
            f"cannot canonicalize {type(error.value).__qualname__} at {path}: {error.reason}"
        ) from None


def _canon(obj: Any) -> Any:
    if type(obj) in _EXACT_SCALARS:
        return obj
    if isinstance(obj, Enum):
        # a Flag of no one name
        return obj.name if obj.name is not None else f"{type(obj).__name__}({obj.value!r})"
    if isinstance(obj, _SCALARS):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _canon_fields(obj, (f.name for f in dataclasses.fields(obj)))
    if isinstance(obj, BaseModel):
        return _canon_fields(obj, (name for name, _ in obj))
    if isinstance(obj, Mapping):
        return _canon_mapping(obj)
    if isinstance(obj, (list, tuple)):
        return _canon_items(obj)
    if isinstance(obj, (set, frozenset)):
        return _sorted(_canon_items(obj, index_parts=False))
    raise _Unsupported(
        obj,
        "supported: dataclasses, pydantic models, mappings, lists, tuples, "
        "sets, enums, None, bool, int, float, str",
    )


def _canon_fields(obj: Any, names: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = _canon(getattr(obj, name))
        except _Unsupported as error:
            error.parts.append(f".{name}")
            raise
    return out


def _canon_mapping(obj: Mapping) -> Keyed:
    items: list[tuple[str, Any]] = []
    for key, value in obj.items():
        text = key.name if isinstance(key, Enum) else str(key)
        try:
            items.append((text, _canon(value)))
        except _Unsupported as error:
            error.parts.append(f"[{text}]")
            raise
    items.sort(key=lambda item: item[0])
    out = Keyed(items)
    if len(out) != len(items):
        raise _Unsupported(obj, "two keys render as the same string")
    return out


def _canon_items(items: Any, *, index_parts: bool = True) -> list[Any]:
    out: list[Any] = []
    for index, item in enumerate(items):
        try:
            out.append(_canon(item))
        except _Unsupported as error:
            error.parts.append(f"[{index}]" if index_parts else "[*]")
            raise
    return out


def _sorted(items: list[Any]) -> list[Any]:
    """Sort set members: natively when they are comparable and hold no NaN (which no order places),
    else by their JSON text; either way the order depends only on the members."""
    if not any(map(_holds_nan, items)):
        try:
            return sorted(items)
        except TypeError:
            pass
    return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))


def _holds_nan(item: Any) -> bool:
    if isinstance(item, float):
        return item != item
    if isinstance(item, dict):
        return any(map(_holds_nan, item.values()))
    return isinstance(item, list) and any(map(_holds_nan, item))


def flatten(canonical: Any, *, like: Any = None) -> dict[str, Any]:
    """Map every leaf path of a canonical form to its value (a new dict).

    Plain dict keys render `.key` (no leading dot at the top: `state.requests`), `Keyed` keys
    `[key]`, list indexes `[i]`. Empty containers are leaves with value `[]` or `{}`, so an
    absent field differs from an empty one. A scalar at the top flattens to `{"": value}`.
    ``like``: another form whose mapping kinds win where both have a mapping at the same place, so
    a `Keyed` and a plain dict of the same items (equal to `==`) name the same paths.
    """
    out: dict[str, Any] = {}
    _flatten(canonical, "", out, like)
    return out


def _child(path: str, key: Any, keyed: bool) -> str:
    """The path of ``key`` under ``path``: `[key]` in a `Keyed` or a list, `.key` in a plain dict. A
    `]` or `\\` in a bracketed key is written `\\]` or `\\\\`, so the component ends where it seems
    to (ids are anyone's strings)."""
    if keyed:
        key = str(key)
        if "]" in key or "\\" in key:
            key = key.replace("\\", "\\\\").replace("]", "\\]")
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _flatten(node: Any, path: str, out: dict[str, Any], like: Any) -> None:
    if isinstance(node, dict):
        if not node:
            out[path] = {}
        mapping = like if isinstance(like, dict) else {}
        keyed = isinstance(like if isinstance(like, dict) else node, Keyed)
        for key, value in node.items():
            _flatten(value, _child(path, key, keyed), out, mapping.get(key))
    elif isinstance(node, list):
        if not node:
            out[path] = []
        items = like if isinstance(like, list) else []
        for index, value in enumerate(node):
            _flatten(
                value, _child(path, index, True), out, items[index] if index < len(items) else None
            )
    else:
        out[path] = node


def shape_difference(
    expected: Any, actual: Any, path: str = "", *, skip: Callable[[str], Any] | None = None
) -> str | None:
    """The path (as `flatten` renders it; `<root>` at the top) of the first place where two
    canonical forms differ in a way their flattened leaves may not show: a container's kind (mapping
    or list), keys or length, or a leaf; None when they are the same, NaN counting as equal to NaN.
    Subtrees whose path ``skip`` accepts are left out (ignored paths).

    Flattened paths are not unique (`{"a.b": 1}` and `{"a": {"b": 1}}` both give `a.b`), so two
    forms with equal flattened leaves can still differ; this walk tells them apart. A `Keyed` and a
    plain dict of the same items are the same here, as they are to `==`. Keys or list items present
    on one side only count unless ``skip`` accepts their paths. Pure."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        keyed = isinstance(expected, Keyed)
        children = [(_child(path, key, keyed), key) for key in expected.keys() | actual.keys()]
        if skip is not None:
            children = [(child, key) for child, key in children if not skip(child)]
        if any(key not in expected or key not in actual for _, key in children):
            return path or "<root>"
        pairs = ((child, expected[key], actual[key]) for child, key in sorted(children))
    elif isinstance(expected, list) and isinstance(actual, list):
        extra = range(min(len(expected), len(actual)), max(len(expected), len(actual)))
        if any(skip is None or not skip(_child(path, index, True)) for index in extra):
            return path or "<root>"
        pairs = (
            (_child(path, index, True), x, y) for index, (x, y) in enumerate(zip(expected, actual))
        )
        if skip is not None:
            pairs = ((child, x, y) for child, x, y in pairs if not skip(child))
    elif isinstance(expected, (dict, list)) or isinstance(actual, (dict, list)):
        return path or "<root>"
    else:
        return None if same_leaf(expected, actual) else path or "<root>"
    for child, x, y in pairs:
        found = shape_difference(x, y, child, skip=skip)
        if found is not None:
            return found
    return None


def same_leaf(a: Any, b: Any) -> bool:
    """Leaf equality where NaN equals NaN (two paths computing the same NaN agree)."""
    return a == b or (a != a and b != b)


def wildcard(path: str) -> str:
    """Replace every bracketed component with `[*]`: `requests[r17].gpu_pages[3]` ->
    `requests[*].gpu_pages[*]`."""
    return _BRACKETED.sub("[*]", path)


def list_item(path: str) -> tuple[str, int] | None:
    """(the list's path, the index) of a path ending in a list index (`pages[3]` -> (`pages`, 3));
    None for any other. A `Keyed` key of digits reads as an index too. Pure."""
    match = _LIST_ITEM.fullmatch(path)
    return None if match is None else (match[1], int(match[2]))
