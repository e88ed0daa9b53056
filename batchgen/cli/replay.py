"""``batchgen replay``: re-run one logged divergence from its record alone; how a command picks
one divergence record of a log (``minimize`` picks the same way)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from batchgen.cli.arg_types import non_negative_int
from batchgen.cli.common import UsageError, print_warnings
from batchgen.exit_codes import EXIT_FAILED, EXIT_OK
from batchgen.kv.gate import KV_BINDING
from batchgen.triage.replay import replay_record
from compare import DivergenceRecord, read_log
from compare.explain import Row, explain, explain_record, row_lines

MAX_PRINTED_ROWS = 20  # rows of values printed per divergence; the rest are counted


def add_replay_command(commands) -> None:
    parser = commands.add_parser(
        "replay",
        help="re-run one logged divergence from its record alone",
        description=(
            "Rebuild the pre-state of one logged divergence from its record, run both KV paths"
            " through the op (a demo bug the run planted in its shadow path planted again), and"
            " show each differing field path with both paths' values, logged and replayed. Exit 0"
            " when the divergence reproduces, 1 when it does not, 2 on bad input (an unreadable"
            " log, an --index out of range, a record replay cannot use)."
        ),
    )
    add_record_args(parser)
    parser.set_defaults(handler=_replay)


def add_record_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", metavar="LOG", help="a divergence log (JSON Lines)")
    parser.add_argument(
        "--index",
        type=non_negative_int,
        required=True,
        metavar="N",
        help=(
            "which divergence: 0 is the log's first divergence record (run summary records are "
            "not counted)"
        ),
    )


def _replay(args: argparse.Namespace) -> int:
    record, count = divergence_record(args.log, args.index)
    outcome = replay_record(record)
    print(
        f"record {args.index} of {count} divergence records in {args.log}: {record_title(record)}"
    )
    if record.replay.get("demo_bug"):
        print(
            f"demo bug:  {record.replay['demo_bug']}, planted in the shadow path"
            f" ({record.shadow}) by --kv-compare-demo-bug, and in the replay"
        )
    logged = explain_record(record)
    print(f"logged:   {_divergence_line(record.kind, tuple(record.field_paths))}")
    _print_rows(logged)
    replayed = explain(outcome.diff, outcome.field_paths, record.authoritative, record.shadow)
    line = _divergence_line(outcome.kind, outcome.field_paths)
    changed = [row for row in replayed if row not in logged]
    if outcome.kind == record.kind and len(changed) < len(replayed):  # rows logged come back
        print(f"replayed: {line}, the values logged" + (" but these:" if changed else ""))
        _print_rows(changed)
    else:
        print(f"replayed: {line}")
        _print_rows(replayed)
    for exception in outcome.exceptions:
        print(f"raised:   {exception}")
    print(f"reproduced: {'yes' if outcome.reproduced else 'no'}")
    return EXIT_OK if outcome.reproduced else EXIT_FAILED


def divergence_record(log: str, index: int) -> tuple[DivergenceRecord, int]:
    """The ``index``-th divergence record of ``log`` and how many it holds; UsageError when out of
    range, or when it is not a record of the KV binding (the one batchgen re-runs)."""
    result = read_log(log)
    print_warnings(result.warnings)
    records = [record for record in result.records if isinstance(record, DivergenceRecord)]
    if not records:
        held = (
            f"its {len(result.records)} records are all run summaries"
            if result.records
            else "it holds no record"
        )
        raise UsageError(f"{log}: no divergence record to pick; {held}")
    if index >= len(records):
        raise UsageError(
            f"--index {index} is out of range: {log} holds {len(records)} divergence records, so "
            f"--index is 0 to {len(records) - 1} (run summaries are not counted)"
        )
    if records[index].binding != KV_BINDING:
        raise UsageError(
            f"{log}: record {index} is of the {records[index].binding!r} binding; batchgen re-runs"
            f" records of the {KV_BINDING!r} binding only"
        )
    return records[index], len(records)


def record_title(record: DivergenceRecord) -> str:
    return (
        f"{record.op} step {record.step} of {record.workload} (seed {record.seed}, run"
        f" {record.run_id}), authoritative {record.authoritative}, shadow {record.shadow}"
    )


def _divergence_line(kind: str | None, paths: tuple[str, ...]) -> str:
    if kind is None:
        return "no divergence: the two paths agree"
    return f"{kind} divergence at {len(paths)} field paths" if paths else f"{kind} divergence"


def _print_rows(rows: Sequence[Row]) -> None:
    for line in row_lines(rows, MAX_PRINTED_ROWS):
        print(f"    {line}")
