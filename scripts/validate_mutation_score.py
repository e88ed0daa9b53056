"""How many bugs ``batchgen validate`` kills: its mutation score over the KV files and the worker.

The tool is cosmic-ray: it takes any test command, so ``batchgen validate --fail-fast`` is the
test command itself (any non-zero exit kills a mutant; a timeout does too, listed apart).
mutmut 3 drives pytest only, and would need validate wrapped in a test. cosmic-ray's session
database is incremental: a stopped run goes on where it stopped, and a finished one is read back
with ``--report-only``.

Method: a clone of the repository at ``--commit`` (cosmic-ray edits source files in place, so
never the tree this runs from), one unmutated validate under coverage (it must pass), every
mutant of the files (cosmic-ray's default operators), a seeded random sample of ``--sample`` of
them, and validate run on each sampled mutant, one at a time. A sampled mutant on a line the
unmutated validate never executes is not run: it would run exactly as unmutated, so it counts as
survived, or as "not executed here" when the line is CUDA-only code (outside the denominator;
run when a GPU is lent). A survivor listed in ``docs/validation.md``'s "Mutation score" table
is equivalent, with the reason there. The score is killed / (killed + survived).

    python scripts/validate_mutation_score.py                  # HEAD, 300 mutants: about an hour
    python scripts/validate_mutation_score.py --report-only    # the table from the cached results
    python scripts/validate_mutation_score.py --commit 1da56cc --sample 300 --seed 0
    python scripts/validate_mutation_score.py --carry-from 019ed97   # rerun only what may change
    python scripts/validate_mutation_score.py --sample 40 --changed-since afefa3b  # new code only

``--carry-from C`` copies C's killed and explained-equivalent results to the same mutants at
``--commit`` and runs the rest (``mutation_carry``): valid while the commits between only add to
what validate checks; the table's header says how many results were carried, and from where.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from mutation_carry import carried_from, carry_results
from mutation_report import load_outcomes, render_survivors, render_table
from mutation_session import (
    changed_lines,
    check_imports_clone,
    clone,
    draw_sample,
    execute,
    init_session,
    measure_executed_lines,
    num_mutants,
    session_dir,
    write_config,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = Path.home() / ".cache" / "batchgen-mutation"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs an integer of at least 1, got {text}")
    return value


def _timeout(text: str) -> float:
    value = float(text)
    if not 1 <= value <= 7200:
        raise argparse.ArgumentTypeError(f"needs seconds in [1, 7200], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=Path(__file__).name,
        description=__doc__.split("\n\n")[0],
        epilog="The method is in this script's docstring; docs/validation.md has the scores.",
    )
    parser.add_argument("--commit", default="HEAD", help="the commit to mutate (default: HEAD)")
    parser.add_argument(
        "--sample", type=_positive_int, default=300, help="mutants sampled (default: 300)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default: 0)")
    parser.add_argument(
        "--timeout",
        type=_timeout,
        default=None,
        metavar="S",
        help="seconds one validate may take before its mutant counts as a timeout "
        "(default: 3x the unmutated validate under coverage)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=DEFAULT_CACHE,
        help="where each commit's session lives (default: %(default)s)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="print the table from the commit's cached session; run nothing",
    )
    parser.add_argument(
        "--survivors",
        type=Path,
        default=None,
        metavar="FILE",
        help="where the survivors go (default: survivors.md in the commit's session directory)",
    )
    _add_session_args(parser)
    return parser


def _add_session_args(parser: argparse.ArgumentParser) -> None:
    """The options that pick which results a session reuses or samples. Mutates ``parser``."""
    parser.add_argument(
        "--carry-from",
        default=None,
        metavar="COMMIT",
        help="reuse that commit's cached killed and equivalent results for the same mutants, "
        "run the rest (only while validate merely gained checks since)",
    )
    parser.add_argument(
        "--changed-since",
        default=None,
        metavar="COMMIT",
        help="sample only the mutants on lines added or changed since that commit (a session of "
        "its own)",
    )


def resolve_commit(commit: str) -> str:
    """The full hash of ``commit`` in this repository; ValueError naming it when there is none."""
    done = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise ValueError(f"--commit {commit}: not a commit of {REPO}")
    return done.stdout.strip()


def run_session(directory: Path, commit: str, args: argparse.Namespace) -> None:
    """Clone, measure, init, sample and execute: each step done once per session directory.
    Mutates ``directory``."""
    src = clone(REPO, commit, directory)
    check_imports_clone(src)
    if not (directory / "executed.json").exists():
        print(f"unmutated validate under coverage in {src} ...", flush=True)
        measure_executed_lines(directory, src)
    timeout_s = args.timeout or 3 * baseline_wall_s(directory)
    config = write_config(directory, src, round(timeout_s))
    all_mutants = init_session(directory, src, config)
    only = changed_lines(src, args.changed_since) if args.changed_since else None
    job_ids = draw_sample(all_mutants, directory, args.sample, args.seed, only)
    if args.carry_from:
        earlier = session_dir(args.cache_dir, args.carry_from)
        copied = carry_results(earlier, directory, REPO / "docs" / "validation.md")
        print(f"{copied} results carried from {earlier.name}", flush=True)
    print(f"validate on each sampled mutant (timeout {timeout_s:.0f} s) ...", flush=True)
    execute(directory, src, config, all_mutants, job_ids)


def baseline_wall_s(directory: Path) -> float:
    return json.loads((directory / "executed.json").read_text())["wall_s"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        commit = resolve_commit(args.commit)
    except ValueError as error:
        parser.error(str(error))
    if args.changed_since:
        try:
            args.changed_since = resolve_commit(args.changed_since)
        except ValueError as error:
            parser.error(str(error).replace("--commit", "--changed-since"))
    directory = session_dir(args.cache_dir, commit, args.changed_since)
    if args.carry_from:
        try:
            args.carry_from = resolve_commit(args.carry_from)
        except ValueError as error:
            parser.error(str(error).replace("--commit", "--carry-from"))
        if not (session_dir(args.cache_dir, args.carry_from) / "session.sqlite").exists():
            parser.error(f"--carry-from: no session for {args.carry_from[:12]} in {args.cache_dir}")
    if args.report_only and not (directory / "session.sqlite").exists():
        parser.error(f"--report-only: no session for {commit[:12]} in {args.cache_dir}")
    if not args.report_only:
        try:
            run_session(directory, commit, args)
        except ValueError as error:  # a sample larger than the files' mutants
            parser.error(str(error))
    outcomes = load_outcomes(directory, REPO / "docs" / "validation.md")
    sample = json.loads((directory / "sample.json").read_text())
    print(
        f"commit {commit[:12]}: {len(outcomes)} mutants sampled (seed {sample['seed']}) of"
        f" {num_mutants(directory)}; test command: batchgen validate --fail-fast"
    )
    for earlier, count in carried_from(directory).items():
        print(f"{count} of these results carried from {earlier} (killed or equivalent there)")
    print(render_table(outcomes))
    survivors = args.survivors or directory / "survivors.md"
    survivors.write_text(render_survivors(outcomes))
    print(f"survivors: {survivors}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
