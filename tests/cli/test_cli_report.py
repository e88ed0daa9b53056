"""``batchgen report``: merging logs, its formats and exit status, logs that did not end."""

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from cli_helpers import error_line, num_divergences

from batchgen.cli import main
from batchgen.cli.report import EMPTY, NOTHING_COMPARED, UNENDED
from compare import JsonlSink, RunSummary, read_log


def test_report_exits_0_without_divergences_and_1_with_them(logs, capsys):
    clean, buggy = logs
    assert main(["report", str(clean)]) == 0
    assert capsys.readouterr().out.startswith("0 divergences in ")
    assert main(["report", str(buggy)]) == 1
    assert capsys.readouterr().out.startswith(f"{num_divergences(buggy)} divergences in ")


def test_report_exits_1_when_the_harness_failed_though_nothing_diverged(tmp_path, capsys):
    log = tmp_path / "harness.jsonl"
    JsonlSink(log).write(
        RunSummary(
            binding="kv",
            run_id="r",
            workload="smoke",
            seed=0,
            authoritative="plan",
            shadow="legacy",
            steps_compared={"alloc": 9},
            divergences={},
            harness_errors=3,
            compare_seconds=0.1,
            authoritative_seconds=0.2,
        )
    )
    assert main(["report", str(log)]) == 1
    assert capsys.readouterr().out.startswith("0 divergences in 9 compared ops, 3 harness errors")


@pytest.mark.parametrize("content", ["", "TORN"], ids=["no-summary", "torn-last-line"])
def test_report_fails_naming_a_log_where_a_run_did_not_end(logs, capsys, tmp_path, content):
    clean, buggy = logs
    unended = tmp_path / "unended.jsonl"  # a run that died having logged no divergence
    unended.write_text(
        clean.read_text() + '{"record_type": "divergence", "sche' if content == "TORN" else ""
    )
    assert main(["report", str(clean), str(unended), "--format", "json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["num_divergences"] == 0  # the report is still rendered
    warning = (
        f"batchgen: warning: {unended}: {UNENDED if content else EMPTY}, so it vouches for nothing"
        " compared"
    )
    assert captured.err.strip().splitlines()[-1] == warning
    assert main(["report", str(buggy), str(unended)]) == 1  # with divergences too
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{num_divergences(buggy)} divergences in ")
    assert captured.err.strip().splitlines()[-1] == warning


def test_report_fails_naming_a_log_where_a_run_died_before_another_appended_to_it(
    logs, capsys, tmp_path
):
    clean, buggy = logs
    died = [
        line
        for line in buggy.read_text().splitlines(keepends=True)
        if '"record_type":"divergence"' in line.replace(" ", "")
    ]  # its divergences, and no summary: the run was killed
    shared = tmp_path / "shared.jsonl"
    # a later run appended to the same log and ended
    shared.write_text("".join(died) + clean.read_text())
    assert died and isinstance(read_log(shared).records[-1], RunSummary)

    assert main(["report", str(shared), "--format", "json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["num_divergences"] == len(died)
    assert (
        captured.err.strip().splitlines()[-1]
        == f"batchgen: warning: {shared}: {UNENDED}, so it vouches for nothing compared"
    )


@pytest.mark.parametrize("format_", ["text", "md", "junit", "json"])
def test_report_renders_each_format(logs, capsys, format_):
    _, buggy = logs
    assert main(["report", str(buggy), "--format", format_]) == 1
    out = capsys.readouterr().out
    count = num_divergences(buggy)
    if format_ == "text":
        assert "By op" in out and "By field path" in out and "requests[*].gpu_page_ids[*]" in out
    elif format_ == "md":
        assert out.startswith(f"### {count} divergences in ") and "| alloc |" in out
    elif format_ == "junit":
        suite = ET.fromstring(out).find("testsuite")
        [failed] = [case for case in suite.iter("testcase") if case.find("failure") is not None]
        assert (failed.get("name"), suite.get("failures")) == ("smoke.alloc", "1")
    else:
        assert json.loads(out)["num_divergences"] == count


def test_report_merges_logs(logs, capsys):
    clean, buggy = logs
    assert main(["report", str(clean), str(buggy), "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["num_runs"], report["num_divergences"]) == (2, num_divergences(buggy))


def test_report_reads_a_log_named_twice_once_with_a_warning(logs, capsys, monkeypatch):
    clean, buggy = logs
    monkeypatch.chdir(buggy.parent)
    assert main(["report", "buggy.jsonl", str(clean), f"./{buggy.name}", "--format", "json"]) == 1
    captured = capsys.readouterr()
    assert (json.loads(captured.out)["num_runs"], json.loads(captured.out)["num_divergences"]) == (
        2,
        num_divergences(buggy),
    )
    assert (
        captured.err
        == "batchgen: warning: ./buggy.jsonl: the same file as buggy.jsonl, given again; read"
        " once\n"
    )


def test_report_fails_a_log_whose_runs_compared_nothing(capsys, tmp_path):
    log = tmp_path / "sampled-nothing.jsonl"
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--kv-compare",
                "log",
                "--kv-compare-sample",
                "1e-9",
                "--kv-compare-log",
                str(log),
            ]
        )
        == 0
    )
    capsys.readouterr()
    [summary] = read_log(log).records
    assert (
        isinstance(summary, RunSummary)
        and summary.stopped_by is None
        and not any(summary.steps_compared.values())
    )
    assert main(["report", str(log)]) == 1  # a CI gate over it would pass on nothing
    captured = capsys.readouterr()
    assert captured.out.startswith("0 divergences in 0 compared ops\n")
    assert (
        captured.err.strip()
        == f"batchgen: warning: {log}: {NOTHING_COMPARED}, so it vouches for nothing"
    )


@pytest.mark.skipif(not os.path.exists("/dev/stdin"), reason="needs /dev/stdin")
def test_report_reads_a_log_piped_to_dev_stdin(logs):
    clean, buggy = logs
    for log, code, headline in (
        (clean, 0, "0 divergences in "),
        (buggy, 1, f"{num_divergences(buggy)} divergences in "),
    ):
        child = subprocess.run(
            [sys.executable, "-m", "batchgen", "report", "/dev/stdin"],
            input=log.read_bytes(),
            capture_output=True,
            timeout=120,
        )
        assert (child.returncode, child.stderr) == (code, b"")
        assert child.stdout.decode().startswith(headline)


def test_report_out_writes_the_file_instead_of_stdout(logs, capsys, tmp_path):
    _, buggy = logs
    out = tmp_path / "ci" / "divergences.xml"
    assert main(["report", str(buggy), "--format", "junit", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(
        rf"batchgen: wrote {re.escape(str(out))}: {num_divergences(buggy)} divergences in "
        r"\d+ compared ops",
        captured.err.strip(),
    )
    assert ET.parse(out).getroot().tag == "testsuites"


@pytest.mark.parametrize(
    "out, reason",
    [("log.jsonl/report.md", "log.jsonl is not a directory"), ("reports", "Is a directory")],
    ids=["under-a-file", "a-directory"],
)
def test_report_out_that_cannot_be_written_exits_2_saying_why(
    logs, capsys, monkeypatch, tmp_path, out, reason
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").mkdir()
    (tmp_path / "log.jsonl").write_bytes(logs[1].read_bytes())
    assert main(["report", "log.jsonl", "--out", out]) == 2
    assert error_line(capsys) == f"batchgen: error: --out {out}: cannot write the report: {reason}"


def test_report_md_is_appended_to_the_github_step_summary(logs, capsys, monkeypatch, tmp_path):
    _, buggy = logs
    summary = tmp_path / "step-summary.md"
    summary.write_text("## earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert main(["report", str(buggy), "--format", "md"]) == 1
    markdown = capsys.readouterr().out
    assert summary.read_text() == "## earlier step\n" + markdown
    assert main(["report", str(buggy), "--format", "junit"]) == 1  # only md goes to the summary
    assert summary.read_text() == "## earlier step\n" + markdown


@pytest.mark.parametrize("which, verdict", [(0, 0), (1, 1)], ids=["clean", "buggy"])
def test_report_whose_step_summary_cannot_be_appended_warns_and_keeps_its_verdict(
    logs, capsys, monkeypatch, tmp_path, which, verdict
):
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path))  # a directory: cannot be appended to
    assert main(["report", str(logs[which]), "--format", "md"]) == verdict
    captured = capsys.readouterr()
    assert captured.out.startswith("#")  # the report itself, written first
    assert (
        captured.err.splitlines()[-1]
        == f"batchgen: warning: $GITHUB_STEP_SUMMARY={tmp_path}: cannot append "
        "the report: Is a directory"
    )


def test_report_without_step_summary_variable_writes_no_summary(
    logs, capsys, monkeypatch, tmp_path
):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(logs[1]), "--format", "md"]) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content, reason",
    [
        (None, "cannot read divergence log: No such file or directory"),
        (
            '{"record_type": "run_summary"\n',
            "1: not JSON: Expecting ',' delimiter: line 1 column 30 (char 29)",
        ),
        (
            "SUMMARY_V9",
            "1: unsupported schema_version 9 in a run_summary record; this reader supports 2, 3",
        ),
        (
            '{"record_type": "divergence", "schema_version": 2}\n',
            "1: invalid divergence record: run_id: field required",
        ),
    ],
    ids=["missing", "not-json", "unknown-schema-version", "missing-fields"],
)
def test_report_exits_2_naming_the_file_line_and_why(logs, capsys, tmp_path, content, reason):
    path = tmp_path / "bad.jsonl"
    if content == "SUMMARY_V9":
        record = json.loads(logs[0].read_text().splitlines()[0])
        content = json.dumps({**record, "schema_version": 9}) + "\n"
    if content is not None:
        path.write_text(content)
    assert main(["report", str(logs[0]), str(path)]) == 2
    message = error_line(capsys)
    assert message.startswith(
        f"batchgen: error: {path}{':' if content is not None else ': '}{reason}"
    ), message


def test_report_skips_a_torn_last_line_with_a_warning(logs, capsys, tmp_path):
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(logs[1].read_bytes() + b'{"record_type": "divergence", "sche')
    assert main(["report", str(torn), "--format", "json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["num_divergences"] == num_divergences(logs[1])
    warning, unended = captured.err.strip().splitlines()
    assert warning.startswith(f"batchgen: warning: {torn}:") and warning.endswith(
        "; skipped as a torn last line"
    )
    assert unended.startswith(f"batchgen: warning: {torn}: a run in it did not end")


def test_report_on_an_empty_log_exits_1_saying_it_holds_no_record(capsys, tmp_path):
    log = tmp_path / "kv.jsonl"
    log.write_text("")
    assert main(["report", str(log)]) == 1
    assert (
        capsys.readouterr().err
        == f"batchgen: warning: {log}: {EMPTY}, so it vouches for nothing compared\n"
    )
