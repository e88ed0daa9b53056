"""Which boundary bugs ``batchgen validate`` catches, with and without its corpus.

Each bug of ``tests/injected_bugs.py: BOUNDARY_BUGS`` (one comparison flipped at an ``==``
boundary of the KV policy, on either path) is injected into this process, and the whole
validation runs twice, in-process, as ``make run`` runs it: once with an empty corpus (the L2
traces alone, the validation before decision coverage) and once with the checked-in corpus.
A bug is caught when validate fails for a reason other than required outcomes left unreached
(which an empty corpus always leaves); the first such failure says how. Prints one row per bug and
the totals; exit 1 when the full validation misses one.

    python scripts/boundary_bugs.py                 # about 12 minutes on one core
    python scripts/boundary_bugs.py --bugs 2        # the first two bugs only
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import pytest

from batchgen.cli import main as batchgen_main

# imported once compare/ is: the tests directory holds a tests/compare/ that would shadow it
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))
from injected_bugs import BOUNDARY_BUGS  # noqa: E402

UNREACHED_FAILURE = "decision coverage: required outcomes never reached"


def caught(corpus: str | None, reports_dir: Path) -> str:
    """Run ``batchgen validate --json`` in this process; its first failure other than required
    outcomes left unreached ("" when there is none)."""
    argv = ["validate", "--json", "--reports-dir", str(reports_dir)]
    if corpus is not None:
        argv += ["--corpus", corpus]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = batchgen_main(argv)
    if code not in (0, 1):
        raise SystemExit(f"batchgen validate exited {code}")
    failures = json.loads(out.getvalue())["failures"]
    return next((f for f in failures if not f.startswith(UNREACHED_FAILURE)), "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bugs", type=int, default=len(BOUNDARY_BUGS), help="the first N bugs")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty-corpus"
        empty.mkdir()
        for bug in BOUNDARY_BUGS[: args.bugs]:
            with pytest.MonkeyPatch.context() as monkeypatch:
                bug.inject(monkeypatch)
                by_l2 = caught(str(empty), Path(tmp) / "l2")
                how = caught(None, Path(tmp) / "full")
            rows.append((bug.name, bool(by_l2), bool(how)))
            print(f"{bug.name:60s} L2 alone: {_verdict(by_l2)}  validate: {_verdict(how)}  "
                  f"{how[:90]}", flush=True)  # fmt: skip
    l2, full = sum(row[1] for row in rows), sum(row[2] for row in rows)
    print(f"caught: L2 traces alone {l2} of {len(rows)}; batchgen validate {full} of {len(rows)}")
    return 0 if full == len(rows) else 1


def _verdict(failure: str) -> str:
    return "caught" if failure else "MISSED"


if __name__ == "__main__":
    sys.exit(main())
