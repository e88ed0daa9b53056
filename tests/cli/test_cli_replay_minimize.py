"""``batchgen replay`` and ``minimize``: a logged divergence re-run, shrunk, written as a test."""

import ast
import errno
import re

import pytest
from cli_helpers import (
    error_line,
    num_divergences,
)
from injected_bugs import reversed_grants

from batchgen.cli import main
from batchgen.cli import minimize as minimize_command
from batchgen.engine.workloads import builtin_workload, load_workload
from batchgen.exit_codes import Terminated


@pytest.mark.parametrize(
    "command, flag, default",
    [
        ("validate", "--reports-dir", "reports"),
        ("report", "--format", "text"),
        ("report", "--out", "stdout"),
        ("minimize", "--out-dir", "reports/minimized"),
        ("minimize", "--max-tests", "400"),
    ],
)
def test_help_of_the_log_commands_gives_each_default(command, flag, default, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(f"{flag} .*?\\(default: {re.escape(default)}\\)", text), flag


def test_minimize_help_says_what_an_interrupt_or_a_spent_budget_writes_and_where_to_keep_the_test(
    capsys,
):
    assert main(["minimize", "--help"]) == 0
    # a line may break after a hyphen
    text = re.sub(r"(?<=\w-) ", "", " ".join(capsys.readouterr().out.split()))
    assert (
        "Ctrl-C or SIGTERM during the search writes that smallest workload and its test the same"
        " way, says so, and exits 130 or 143; if no candidate has diverged yet, nothing is written"
        in text
    )
    assert (
        "When --max-tests runs out first, it writes the smallest diverging workload found so far"
        in text
    )
    assert "move both files into tests/ to keep the test" in text


def test_replay_reproduces_a_logged_divergence_while_the_bug_is_there(logs, capsys, monkeypatch):
    _, buggy = logs
    reversed_grants(monkeypatch)
    count = num_divergences(buggy)
    assert main(["replay", str(buggy), "--index", str(count - 1)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        rf"record {count - 1} of {count} divergence records in {re.escape(str(buggy))}: alloc step "
        r"\d+ of smoke \(seed 0, run smoke-\w+\), authoritative legacy, shadow plan",
        lines[0],
    )
    logged = re.fullmatch(r"logged:   state divergence at (\d+) field paths", lines[1])
    replayed = lines.index(
        f"replayed: state divergence at {logged[1]} field paths, the values logged"
    )
    # the logged rows, once: each field path (runs of indices collapsed) with both paths' values
    rows = lines[2:replayed]
    assert rows and all(line.startswith("    ") for line in rows)
    assert any(
        re.fullmatch(r"    requests\[smoke-r\d+\]\.gpu_page_ids\[\d+\.\.\d+\]  legacy: \[[\d, ]+\]"
                     r"  plan: \[[\d, ]+\]", line)
        for line in rows
    )  # fmt: skip
    assert lines[replayed + 1 :] == ["reproduced: yes"]


def test_replay_exits_1_once_the_bug_is_fixed(logs, capsys):
    assert main(["replay", str(logs[1]), "--index", "0"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "replayed: no divergence: the two paths agree" in lines and lines[-1] == "reproduced: no"


def test_replay_index_out_of_range_exits_2_naming_the_range(logs, capsys):
    clean, buggy = logs
    count = num_divergences(buggy)
    assert main(["replay", str(buggy), "--index", str(count)]) == 2
    assert (
        error_line(capsys)
        == f"batchgen: error: --index {count} is out of range: {buggy} holds {count} "
        f"divergence records, so --index is 0 to {count - 1} (run summaries are not counted)"
    )
    assert main(["replay", str(clean), "--index", "0"]) == 2
    assert (
        error_line(capsys)
        == f"batchgen: error: {clean}: no divergence record to pick; its 1 records are all run "
        "summaries"
    )


def test_minimize_writes_the_minimal_workload_and_a_regression_test(
    logs, capsys, monkeypatch, tmp_path
):
    reversed_grants(monkeypatch)
    out_dir = tmp_path / "minimized"
    assert main(["minimize", str(logs[1]), "--index", "0", "--out-dir", str(out_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    smoke = builtin_workload("smoke")
    shrink = re.fullmatch(
        r"alloc state divergence \(pools.gpu\[\*\].page_ids\[\*\],"
        r" requests\[\*\].gpu_page_ids\[\*\]\): "
        rf"requests 8 -> 1, new tokens {sum(r.max_new_tokens for r in smoke.requests)} -> 1, "
        r"(\d+) tests run",
        lines[0],
    )
    assert shrink and int(shrink[1]) > 0, lines[0]
    [workload_path] = out_dir.glob("*.json")
    [test_path] = out_dir.glob("test_kv_*.py")
    assert lines[1:] == [f"workload: {workload_path}", f"test:     {test_path}"]
    assert len(load_workload(str(workload_path)).requests) == 1
    tree = ast.parse(test_path.read_text())
    assert [node.name for node in tree.body if isinstance(node, ast.FunctionDef)] == [
        f"test_no_{workload_path.stem}_divergence"
    ]


def test_minimize_exits_1_when_the_divergence_does_not_reproduce(logs, capsys, tmp_path):
    assert (
        main(
            ["minimize", str(logs[1]), "--index", "0", "--out-dir", str(tmp_path / "new" / "tests")]
        )
        == 1
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("batchgen:")]
    assert errors == [
        "batchgen: not reproduced: alloc step 0: workload 'smoke' (seed 0, scale 1.0) shows no"
        " state divergence at pools.gpu[*].page_ids[*], requests[*].gpu_page_ids[*]"
    ]
    assert list(tmp_path.iterdir()) == []


def interrupting_minimize(monkeypatch, num_tests, interrupt):
    """Make ``batchgen minimize``'s search raise ``interrupt`` once its ``num_tests``-th candidate
    has run, as Ctrl-C or SIGTERM would."""
    search = minimize_command.minimize_divergence

    def minimize(record, *, on_test, **kwargs):
        def test_then_interrupt(done, smallest):
            on_test(done, smallest)
            if done == num_tests:
                raise interrupt

        return search(record, on_test=test_then_interrupt, **kwargs)

    monkeypatch.setattr(minimize_command, "minimize_divergence", minimize)


@pytest.mark.parametrize(
    "interrupt, code, last_line",
    [
        (KeyboardInterrupt(), 130, "batchgen: interrupted"),
        (Terminated(), 143, "batchgen: terminated"),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_an_interrupted_minimize_writes_the_smallest_diverging_workload_so_far(
    logs, capsys, monkeypatch, tmp_path, interrupt, code, last_line
):
    reversed_grants(monkeypatch)
    interrupting_minimize(monkeypatch, 2, interrupt)
    out_dir = tmp_path / "new" / "minimized"
    assert main(["minimize", str(logs[1]), "--index", "0", "--out-dir", str(out_dir)]) == code
    captured = capsys.readouterr()
    [workload_path] = out_dir.glob("*.json")
    [test_path] = out_dir.glob("test_kv_*.py")
    assert captured.out.splitlines()[1:] == [f"workload: {workload_path}", f"test:     {test_path}"]
    assert re.fullmatch(
        r"alloc state divergence \(.*\): requests 8 -> 4, new tokens \d+ -> \d+, 2 tests run",
        captured.out.splitlines()[0],
    )
    assert [r.uuid for r in load_workload(str(workload_path)).requests] == [
        f"smoke-r{i}" for i in range(4)
    ]
    errors = [line for line in captured.err.splitlines() if line.startswith("batchgen:")]
    assert errors == [
        (
            "batchgen: minimize was interrupted after 2 tests: the workload written is the smallest"
            " that diverged so far (4 of 8 requests) and may not be minimal; delete its two files"
            " and run minimize again to search to the end"
        ),
        last_line,
    ]


def test_an_interrupted_minimize_that_cannot_write_still_exits_as_interrupted(
    logs, capsys, monkeypatch, tmp_path
):
    def full_disk(out_dir, result):
        raise OSError(errno.ENOSPC, "No space left on device")

    reversed_grants(monkeypatch)
    interrupting_minimize(monkeypatch, 2, KeyboardInterrupt())
    monkeypatch.setattr(minimize_command, "write_regression_into", full_disk)
    assert (
        main(["minimize", str(logs[1]), "--index", "0", "--out-dir", str(tmp_path / "minimized")])
        == 130
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("batchgen:")]
    assert errors == [
        (
            "batchgen: warning: cannot write the smallest diverging workload found: No space left"
            " on device"
        ),
        "batchgen: interrupted",
    ]


def test_minimize_interrupted_before_any_candidate_diverged_writes_nothing(
    logs, capsys, monkeypatch, tmp_path
):
    # the bug is fixed: the first candidate agrees
    interrupting_minimize(monkeypatch, 1, KeyboardInterrupt())
    assert (
        main(
            [
                "minimize",
                str(logs[1]),
                "--index",
                "0",
                "--out-dir",
                str(tmp_path / "new" / "minimized"),
            ]
        )
        == 130
    )
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines()[-1] == "batchgen: interrupted"
    assert list(tmp_path.iterdir()) == []


def test_minimize_warns_when_the_max_tests_budget_runs_out(logs, capsys, monkeypatch, tmp_path):
    reversed_grants(monkeypatch)
    out_dir = tmp_path / "minimized"
    assert (
        main(
            [
                "minimize",
                str(logs[1]),
                "--index",
                "0",
                "--out-dir",
                str(out_dir),
                "--max-tests",
                "3",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert re.fullmatch(
        r"alloc state divergence \(.*\): requests 8 -> 2, new tokens \d+ -> \d+, 3 tests run",
        captured.out.splitlines()[0],
    )
    assert len(list(out_dir.iterdir())) == 2
    errors = [line for line in captured.err.splitlines() if line.startswith(("batchgen:", "/"))]
    assert errors == [
        "batchgen: warning: the --max-tests budget (3) ran out before the search finished: the"
        " workload may not be minimal; delete its two files and rerun with a larger --max-tests"
    ]


def test_minimize_into_the_default_out_dir_says_how_to_keep_the_test(
    logs, capsys, monkeypatch, tmp_path
):
    reversed_grants(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["minimize", str(logs[1]), "--index", "0"]) == 0
    captured = capsys.readouterr()
    [test_path] = (tmp_path / "reports" / "minimized").glob("test_kv_*.py")
    assert captured.out.splitlines()[-1] == f"test:     {test_path.relative_to(tmp_path)}"
    assert (
        captured.err.splitlines()[-1]
        == "batchgen: reports/minimized is git-ignored and `make clean` deletes it: to keep the"
        " regression test, move both files into tests/, where `make test` runs it (it fails"
        " until the bug is fixed)"
    )
