"""Crash safety: a compare run killed with SIGKILL leaves a log whose complete records all read
back, and a report written with ``--out`` is the old file or the new one, never half of one.

The killed runs are child processes (``python -c``) that install a buggy plan method, so that
divergence records stream into the log, and then call ``batchgen.cli.main``.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import batchgen.cli
from batchgen.cli import main
from batchgen.cli.report import UNENDED
from compare import DivergenceRecord, read_log
from compare.records import RunSummary
from compare.sink import JsonlSink

REPO = Path(__file__).resolve().parents[1]
MIN_RECORDS = 12  # complete log lines to wait for before the kill
# for the child to log them (its imports and the model load come first, on busy cores)
DEADLINE_S = 240

# A child run in compare mode "log" whose plan path reverses every multi-page grant: it logs an
# alloc divergence at nearly every prefill, for as long as it lives.
BUGGY_RUN = textwrap.dedent("""
    import sys
    import torch
    import batchgen.kv.manager as kv_manager
    from batchgen.kv.plans import AllocPlan, PageGrant

    torch.set_num_threads(1)
    correct = kv_manager.KVCacheManager.plan_allocation

    def plan_allocation(self, req):
        plan = correct(self, req)
        grants = tuple(PageGrant(g.uuid, g.new_page_ids[::-1]) for g in plan.grants)
        return AllocPlan(grants, plan.not_fitting)

    kv_manager.KVCacheManager.plan_allocation = plan_allocation
    from batchgen.cli import main
    sys.exit(main(["run", "--workload", "L2-2048", "--kv-path", "legacy", "--kv-compare", "log",
                   "--kv-compare-log", sys.argv[1], "--json"]))
""")


def child_env() -> dict:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("BATCHGEN_WORKER_KV_")
    }
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def complete_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.fixture(scope="module")
def killed_log(tmp_path_factory) -> Path:
    """The log of a buggy L2-2048 compare run SIGKILLed once it held MIN_RECORDS complete lines."""
    log = tmp_path_factory.mktemp("killed") / "kv.jsonl"
    child = subprocess.Popen(
        [sys.executable, "-c", BUGGY_RUN, str(log)],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + DEADLINE_S
        while (
            complete_lines(log) < MIN_RECORDS
            and child.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert child.poll() is None, f"the run ended (exit {child.returncode}) before it was killed"
        assert complete_lines(log) >= MIN_RECORDS, (
            f"fewer than {MIN_RECORDS} records after {DEADLINE_S} s"
        )
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    return log


# ---- a killed compare run ------------------------------------------------------------------------
def test_every_complete_record_of_a_killed_run_reads_back(killed_log):
    data = killed_log.read_bytes()
    result = read_log(killed_log)
    assert result.num_read == data.count(b"\n") >= MIN_RECORDS
    # the line the kill cut short, if any
    assert result.num_skipped == (0 if data.endswith(b"\n") else 1)
    # killed before its summary
    assert all(isinstance(record, DivergenceRecord) for record in result.records)
    assert {record.op for record in result.records} == {"alloc"}


def test_report_on_a_killed_run_counts_its_divergences(killed_log, capsys):
    assert main(["report", str(killed_log), "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["num_divergences"] == read_log(killed_log).num_read
    # no summary record: no denominators
    assert (report["num_runs"], report["num_compared"]) == (0, 0)


def test_report_on_a_log_torn_mid_record_warns_and_counts_the_complete_ones(
    killed_log, capsys, tmp_path
):
    torn = tmp_path / "torn.jsonl"
    data = killed_log.read_bytes()
    complete = data[: data.rindex(b"\n") + 1]
    last = complete.splitlines(keepends=True)[-1]
    # as if the kill hit in the middle of a write
    torn.write_bytes(complete + last[: len(last) // 2])
    num_complete = complete.count(b"\n")
    assert main(["report", str(torn)]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{num_complete} divergences in 0 compared ops")
    assert captured.err.startswith(f"batchgen: warning: {torn}:{num_complete + 1}: not JSON")


def test_a_run_appended_after_a_torn_line_leaves_a_readable_log(killed_log, capsys, tmp_path):
    """The sink cuts the torn line off before appending: every complete record and the new one read
    back."""
    log = tmp_path / "kv.jsonl"
    data = killed_log.read_bytes()
    complete = data[: data.rindex(b"\n") + 1]
    log.write_bytes(complete + b'{"record_type": "diverg')
    summary = RunSummary(
        binding="kv",
        run_id="next",
        workload="smoke",
        seed=0,
        authoritative="legacy",
        shadow="plan",
        steps_compared={"alloc": 1},
        divergences={},
        harness_errors=0,
        compare_seconds=0.0,
        authoritative_seconds=0.0,
    )
    with pytest.warns(UserWarning, match="last line was cut short"), JsonlSink(log) as sink:
        sink.write(summary)
    records = read_log(log).records
    assert len(records) == complete.count(b"\n") + 1 and records[-1] == summary
    assert main(["report", str(log)]) == 1  # the killed run's divergences are all there
    assert (
        capsys.readouterr().err
        == f"batchgen: warning: {log}: {UNENDED}, so it vouches for nothing compared\n"
    )


# ---- report --out: the old file or the new one, never half of one -------------------------------
OLD_REPORT = "### the previous report\n"


@pytest.fixture
def previous_report(tmp_path) -> Path:
    path = tmp_path / "out" / "divergences.md"
    path.parent.mkdir()
    path.write_text(OLD_REPORT)
    return path


def leftovers(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name != "divergences.md")


def test_a_renderer_that_fails_midway_leaves_the_old_report_intact(
    killed_log, previous_report, monkeypatch
):
    real_render = batchgen.cli.RENDERERS["md"]

    def render_then_fail(report):
        real_render(report)  # the report is half built when it fails
        raise RuntimeError("renderer crashed")

    monkeypatch.setitem(batchgen.cli.RENDERERS, "md", render_then_fail)
    with pytest.raises(RuntimeError, match="renderer crashed"):
        main(["report", str(killed_log), "--format", "md", "--out", str(previous_report)])
    assert previous_report.read_text() == OLD_REPORT
    assert leftovers(previous_report.parent) == []


def test_a_write_that_fails_before_the_rename_leaves_the_old_report_and_no_temp_file(
    killed_log, previous_report, monkeypatch, capsys
):
    def no_space(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("compare.sink.os.replace", no_space)
    assert main(["report", str(killed_log), "--format", "md", "--out", str(previous_report)]) == 2
    assert (
        capsys.readouterr().err
        == f"batchgen: warning: {killed_log}: {UNENDED}, so it vouches for nothing compared\n"
        f"batchgen: error: --out {previous_report}: cannot write the report: "
        "No space left on device\n"
    )
    assert previous_report.read_text() == OLD_REPORT
    assert leftovers(previous_report.parent) == []


# The child dies (SIGKILL) inside write_atomic, once the new report is in its temp file and before
# the rename.
KILLED_WRITE = textwrap.dedent("""
    import os, signal, sys
    from batchgen.cli import main

    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(main(["report", sys.argv[1], "--format", "md", "--out", sys.argv[2]]))
""")


@pytest.mark.parametrize("had_report", [True, False], ids=["replacing", "new"])
def test_a_process_killed_while_writing_the_report_leaves_the_old_file_or_none(
    killed_log, previous_report, had_report
):
    if not had_report:
        previous_report.unlink()
    child = subprocess.run(
        [sys.executable, "-c", KILLED_WRITE, str(killed_log), str(previous_report)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        timeout=DEADLINE_S,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    if had_report:
        assert previous_report.read_text() == OLD_REPORT
    else:
        assert not previous_report.exists()
    # the kill left the finished temp file: never the report itself
    [temp] = leftovers(previous_report.parent)
    assert temp.startswith(".divergences.md.") and temp.endswith(".tmp")
