"""``--kv-verify`` on ``batchgen run``: the oracle's counts in the run summary, its data
divergences in the compare log even with compare mode off, no warning for the log it writes."""

from __future__ import annotations

import json

from data_plane_bugs import runs_whose_destination_does_not_advance

from batchgen.cli import main
from batchgen.kv import copy_runs
from compare import DivergenceRecord, read_log


def run_smoke(capsys, *args: str) -> tuple[dict, list[str]]:
    assert main(["run", "--workload", "smoke", "--json", *args]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), [
        line for line in captured.err.splitlines() if "warning" in line
    ]


def test_verify_all_counts_its_checks_and_writes_no_log_when_the_pages_are_right(capsys, tmp_path):
    log = tmp_path / "kv.jsonl"
    summary, warnings = run_smoke(capsys, "--kv-verify", "all", "--kv-compare-log", str(log))
    assert (summary["kv_verify"], summary["data_divergences"], warnings) == ("all", 0, [])
    assert summary["data_checked"]["load"] > 0 and summary["data_checked"]["append"] > 0
    assert summary["copy_patterns"]["copy.store.consecutive"] > 0
    assert not log.exists()


def test_with_compare_off_data_divergences_go_to_the_compare_log(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(copy_runs, "pair_runs", runs_whose_destination_does_not_advance)
    monkeypatch.setenv("BATCHGEN_WORKER_KV_VERIFY", "all")
    log = tmp_path / "kv.jsonl"
    summary, _ = run_smoke(capsys, "--kv-compare-log", str(log))
    records = [r for r in read_log(log).records if isinstance(r, DivergenceRecord)]
    assert summary["data_divergences"] == len(records) > 0
    assert {(r.kind, r.op, r.workload) for r in records} == {("data", "poll", "unnamed")}


def test_the_option_turns_verify_off_over_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_VERIFY", "all")
    summary, _ = run_smoke(capsys, "--kv-verify", "off")
    assert summary["kv_verify"] == "off" and "data_checked" not in summary
