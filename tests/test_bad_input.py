"""Bad input: every case of ``bad_inputs.CASES`` exits 2 with one clear error line and leaves
nothing behind; ``docs/reliability.md`` is the table of those cases and their actual messages."""

import os
import re
import sys
from pathlib import Path

import pytest
from bad_inputs import (
    CASES,
    CATEGORIES,
    ISOLATED_ENV,
    NOISE,
    REGEN_COMMAND,
    invoke,
    render_doc,
    run_case,
)

from batchgen.kv.gate import ENV_PREFIX

DOC = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"


def contents(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` -> its bytes (None for a directory)."""
    return {
        str(path.relative_to(directory)): None if path.is_dir() else path.read_bytes()
        for path in sorted(directory.rglob("*"))
    }


def as_param(case):
    marks = [pytest.mark.xfail(strict=True, reason=case.known_bug)] if case.known_bug else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [as_param(case) for case in CASES])
def test_bad_input_exits_2_with_one_clear_error_line_and_writes_nothing(
    case, tmp_path, monkeypatch, capsys
):
    for name in [
        name for name in os.environ if name.startswith(ENV_PREFIX) or name in ISOLATED_ENV
    ]:
        monkeypatch.delenv(name)
    for name, value in case.env:
        monkeypatch.setenv(name, value)
    if case.build is not None:
        case.build(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = contents(tmp_path)

    exit_code = invoke(case.argv, sys.stderr)

    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert exit_code == 2, f"{case.command}: exit {exit_code}, stderr:\n{captured.err}"
    assert len(lines) == 1 and lines[0].startswith("batchgen: error: "), (
        f"{case.command}: stderr:\n{captured.err}"
    )
    assert [fragment for fragment in case.expected if fragment not in lines[0]] == [], lines[0]
    assert [noise for noise in NOISE if noise in lines[0]] == [], lines[0]
    assert captured.out == ""
    assert [output for output in case.outputs if (tmp_path / output).exists()] == []
    assert contents(tmp_path) == before  # nothing created, changed or removed


def test_every_case_has_a_unique_id_a_known_category_and_fragments():
    assert len({case.id for case in CASES}) == len(CASES)
    assert {case.category for case in CASES} == set(CATEGORIES)
    assert all(case.expected and case.description for case in CASES)


def portable(markdown: str) -> str:
    """``markdown`` with argparse's choice lists unquoted (Python versions differ in quoting them)
    and the memory a machine has available masked."""
    markdown = re.sub(
        r"\(choose from ([^)]*)\)",
        lambda match: f"(choose from {match[1].replace(chr(39), '')})",
        markdown,
    )
    return re.sub(r"[\d.]+ GiB is available", "N GiB is available", markdown)


def test_reliability_doc_is_up_to_date(tmp_path_factory):
    outcomes = {case.id: run_case(case, tmp_path_factory.mktemp(case.id)) for case in CASES}
    current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    assert portable(current) == portable(render_doc(outcomes)), (
        f"docs/reliability.md is out of date; regenerate it with: {REGEN_COMMAND}"
    )
