"""Regenerate ``docs/reliability.md``: run every case of ``tests/bad_inputs.py`` and tabulate its
message.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/gen_reliability_doc.py

Each case runs in-process in its own empty temporary directory, exactly as
``tests/test_bad_input.py`` runs it; the file is replaced atomically. Prints one
summary line; exit 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
sys.path.insert(0, str(ROOT))
# appended: tests/compare (no __init__) must not shadow the compare package
sys.path.append(str(ROOT / "tests"))

import torch  # noqa: E402
from bad_inputs import CASES, render_doc, run_case  # noqa: E402

from compare import write_atomic  # noqa: E402


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Takes no arguments."
    ).parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="batchgen-bad-inputs-") as temp:
        outcomes = {}
        for case in CASES:
            workdir = Path(temp) / case.id
            workdir.mkdir()
            outcomes[case.id] = run_case(case, workdir)
    write_atomic(DOC, render_doc(outcomes))
    num_known_bugs = sum(case.known_bug is not None for case in CASES)
    print(f"wrote {DOC.relative_to(ROOT)}: {len(CASES)} cases, {num_known_bugs} not handled yet")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
