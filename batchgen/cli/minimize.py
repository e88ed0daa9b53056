"""``batchgen minimize``: shrink a logged divergence to a minimal workload and a regression test."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from batchgen.cli.arg_types import positive_int
from batchgen.cli.common import UsageError, make_directory, print_warnings, remove_empty
from batchgen.cli.replay import add_record_args, divergence_record, record_title
from batchgen.cli.run_flags import refuse_production_settings
from batchgen.engine.workloads import Workload
from batchgen.exit_codes import EXIT_FAILED, EXIT_OK
from batchgen.triage.minimize import NotReproduced, minimize_divergence, recorded_run
from batchgen.triage.minimize_search import MinimizeResult, TestCallback
from batchgen.triage.regression import write_regression_into

# minimize's default --out-dir: git-ignored, and `make clean` deletes reports/
MINIMIZED_DIR = "reports/minimized"


def add_minimize_command(commands) -> None:
    parser = commands.add_parser(
        "minimize",
        help="shrink a logged divergence to a minimal workload and a regression test",
        description=(
            "Delta-debug the workload of one logged divergence (requests, then their steps) down to"
            " a minimal one that still diverges the same way on the tiny model, and write it with a"
            " pytest regression test that fails until the bug is fixed. When --max-tests runs out"
            " first, it writes the smallest diverging workload found so far and warns that it may"
            " not be minimal (exit 0). Ctrl-C or SIGTERM during the search writes that smallest"
            " workload and its test the same way, says so, and exits 130 or 143; if no candidate"
            " has diverged yet, nothing is written. Exit 0 when it wrote them, 1 when the"
            " divergence does not reproduce on its workload, 2 on bad input (an unreadable log, an"
            " --index out of range, a record minimize cannot use)."
        ),
    )
    add_record_args(parser)
    parser.add_argument(
        "--out-dir",
        default=MINIMIZED_DIR,
        metavar="DIR",
        help=(
            "where the workload JSON and the test go; reports/ is git-ignored and `make clean` "
            "deletes it, and `make test` runs tests/ only: move both files into tests/ to keep "
            "the test (default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--max-tests",
        type=positive_int,
        default=400,
        metavar="N",
        help=(
            "candidate workloads run at most; the result may not be minimal when they run out "
            "(default: %(default)s)"
        ),
    )
    parser.set_defaults(handler=_minimize)


def _minimize(args: argparse.Namespace) -> int:
    refuse_production_settings("minimize")
    record, count = divergence_record(args.log, args.index)
    replay = record.replay
    if not replay.get("workload_source"):
        raise UsageError(
            f"{args.log}: divergence record {args.index} names no workload_source to minimize"
        )
    # a payload the search cannot use fails before --out-dir is made
    original, _, _ = recorded_run(record)
    made = make_directory("--out-dir", args.out_dir)  # before the search, which takes minutes
    print(
        f"minimizing record {args.index} of {count} in {args.log}: {record_title(record)}",
        file=sys.stderr,
    )
    # the smallest diverging workload when Ctrl-C or SIGTERM ends the search
    interrupted: list[MinimizeResult] = []
    try:
        with _candidate_progress(args.max_tests, len(original.requests)) as on_test:
            result = minimize_divergence(
                record, max_tests=args.max_tests, on_test=on_test, on_interrupt=interrupted.append
            )
    except BaseException as error:  # not reproduced, a payload it cannot use, Ctrl-C or SIGTERM
        # a candidate diverged before the interrupt: keep the smallest, then exit 130 or 143
        if interrupted:
            try:
                _write_minimized(args, original, interrupted[0])
            except OSError as failed:  # the interrupt stays what ends the command
                print(
                    "batchgen: warning: cannot write the smallest diverging workload found: "
                    f"{failed.strerror or failed}",
                    file=sys.stderr,
                )
            raise
        remove_empty(made)  # nothing was written
        if not isinstance(error, NotReproduced):
            raise
        print(f"batchgen: not reproduced: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_FAILED
    _write_minimized(args, original, result)
    return EXIT_OK


def _write_minimized(args: argparse.Namespace, original: Workload, result: MinimizeResult) -> None:
    """Write ``result``'s workload and regression test into ``--out-dir``, print what shrank and the
    two paths on stdout, and on stderr why the search stopped early (it may not be minimal) and
    where to keep the test."""
    workload_path, test_path = write_regression_into(args.out_dir, result)
    minimal = result.workload.requests
    print(
        f"{result.signature.op} {result.signature.kind} divergence"
        f" ({', '.join(result.signature.field_paths) or '-'}): requests {len(original.requests)} ->"
        f" {len(minimal)}, new tokens {sum(r.max_new_tokens for r in original.requests)} ->"
        f" {sum(r.max_new_tokens for r in minimal)}, {result.num_tests} tests run"
        + (f", under faults {result.faults}" if result.faults else "")
        + (f", demo bug {result.demo_bug} planted in the shadow path" if result.demo_bug else "")
    )
    print(f"workload: {workload_path}")
    print(f"test:     {test_path}")
    sys.stdout.flush()  # stdout and stderr sent to one file keep this order
    if result.stopped_by == "interrupted":
        print(
            f"batchgen: minimize was interrupted after {result.num_tests} tests: the workload"
            f" written is the smallest that diverged so far ({len(minimal)} of"
            f" {len(original.requests)} requests) and may not be minimal; delete its two files and"
            " run minimize again to search to the end",
            file=sys.stderr,
        )
    elif result.stopped_by == "max_tests":
        print_warnings(
            [
                f"the --max-tests budget ({args.max_tests}) ran out before the search finished: the"
                " workload may not be minimal; delete its two files and rerun with a larger"
                " --max-tests"
            ]
        )
    if Path(args.out_dir).resolve() == Path(MINIMIZED_DIR).resolve():
        print(
            f"batchgen: {MINIMIZED_DIR} is git-ignored and `make clean` deletes it: to keep the"
            " regression test, move both files into tests/, where `make test` runs it (it fails"
            " until the bug is fixed)",
            file=sys.stderr,
        )


@contextmanager
def _candidate_progress(max_tests: int, num_requests: int) -> Iterator[TestCallback]:
    """A progress bar on stderr over the candidate workloads minimize runs, naming the smallest that
    diverged; yields its ``on_test``."""
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} candidates"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task(f"minimizing {num_requests} requests", total=max_tests)

        def on_test(num_tests: int, smallest: int | None) -> None:
            shrunk = (
                f"diverges with {smallest} of {num_requests} requests"
                if smallest is not None
                else (f"minimizing {num_requests} requests")
            )
            progress.update(task, completed=num_tests, description=shrunk)

        yield on_test
