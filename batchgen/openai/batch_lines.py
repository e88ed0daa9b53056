"""One line of an OpenAI batch input file, read: ``{"custom_id", "method": "POST", "url",
"body"}``, or the error that line gets (not JSON, a field missing or of the wrong type).

A line that is not JSON keeps its line number and, when a ``"custom_id": "..."`` can be read from
its text, that id; its result line is keyed by ``resume_key`` so ``--resume`` finds it again.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

LINE_FIELDS = ("custom_id", "method", "url", "body")
_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class BatchLine:
    number: int  # 1-based line number in the input
    custom_id: str
    url: str
    body: object


@dataclass(frozen=True, slots=True)
class LineError:
    """A line that gets an error result. ``status`` None: no HTTP request could be read from it
    (not JSON, no custom_id): the result's top-level ``error``; else a ``response`` of that
    status."""

    number: int
    custom_id: str | None
    status: int | None
    message: str
    param: str | None = None


def resume_key(custom_id: str | None, number: int) -> str:
    """What a result line is matched by on ``--resume``: its custom_id, or, for a line without a
    readable one, its line number. Pure."""
    return custom_id if custom_id is not None else f"line {number}"


def read_line(number: int, text: str) -> BatchLine | LineError:
    """Line ``number`` of the input (``text``, without its newline), read. Pure."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        found = _CUSTOM_ID.search(text)
        custom_id = _unescape(found.group(1)) if found else None
        return LineError(number, custom_id, None, f"line {number}: not JSON ({error})")
    if not isinstance(data, dict):
        return LineError(number, None, None, f"line {number}: not a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(number, None, None, f"line {number}: custom_id must be a non-empty string")
    unknown = sorted(set(data) - set(LINE_FIELDS))
    if unknown:
        message = f"unknown field {unknown[0]!r} in the line; allowed: {', '.join(LINE_FIELDS)}"
        return LineError(number, custom_id, 400, message, unknown[0])
    if data.get("method", "POST") != "POST":
        return LineError(number, custom_id, 400, "method must be POST", "method")
    if not isinstance(data.get("url"), str):
        return LineError(number, custom_id, 400, "url must be a string", "url")
    if "body" not in data:
        return LineError(number, custom_id, 400, "body is missing", "body")
    return BatchLine(number, custom_id, data["url"], data["body"])


def _unescape(text: str) -> str | None:
    """A JSON string's escaped content as text; None when it is no valid JSON string. Pure."""
    try:
        return json.loads(f'"{text}"')
    except json.JSONDecodeError:
        return None
