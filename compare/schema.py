"""The JSON Schema of a log line (``compare.records``), as published in the docs.

Regenerate the checked-in schema after changing a record:

    python -m compare.schema docs/divergence.schema.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import TypeAdapter

from compare.records import SCHEMA_VERSION, LogRecord


def json_schema() -> dict:
    """The JSON Schema of one log line (either record type)."""
    schema = TypeAdapter(LogRecord).json_schema()
    schema["title"] = "compare log record"
    schema["description"] = (
        f"One line of a compare divergence log (JSON Lines), schema_version {SCHEMA_VERSION}."
    )
    return schema


def write_json_schema(path: str | Path) -> None:
    """Write `json_schema()` to `path` (replaces the file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_schema(), indent=2, sort_keys=True) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(
            "usage: python -m compare.schema PATH  (writes the log record JSON Schema)",
            file=sys.stderr,
        )
        return 2
    write_json_schema(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
