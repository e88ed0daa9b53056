"""``batchgen validate --fail-fast``: the first failed check stops the validation, exit 1.

Runs on the two small pressure workloads of ``test_validation`` (seconds).
"""

import re

from injected_bugs import reversed_grants
from test_validation import one_json_object, pressure_workload, use_workloads

from batchgen.cli import main
from batchgen.kv.backends import GpuKvPool
from compare import DivergenceRecord, read_log


def test_fail_fast_stops_at_the_first_divergence_and_names_only_that_run(
    monkeypatch, tmp_path, capsys
):
    use_workloads(
        monkeypatch, tmp_path, pressure_workload("pa", seed=1), pressure_workload("pb", seed=2)
    )
    reversed_grants(monkeypatch)
    reports = tmp_path / "reports"
    assert main(["validate", "--fail-fast", "--json", "--reports-dir", str(reports)]) == 1
    report = one_json_object(capsys.readouterr().out)
    assert len(report["failures"]) == 1, report["failures"]
    assert re.fullmatch(
        r"pa legacy/plan: 1 divergence of the plan shadow from the authoritative legacy path"
        r" \(alloc: 1\); first: alloc step \d+, state at pools\.gpu\[\d+\]\.page_ids\[\d+\].*",
        report["failures"][0],
    )
    # the first compare run broke off at its divergence: nothing ran after it
    assert report["runs"] == []
    records = read_log(reports / "divergences.jsonl").records
    divergences = [record for record in records if isinstance(record, DivergenceRecord)]
    assert [(record.workload, record.op) for record in divergences] == [("pa legacy/plan", "alloc")]


def test_fail_fast_stops_after_the_first_run_whose_check_failed(monkeypatch, tmp_path, capsys):
    use_workloads(
        monkeypatch, tmp_path, pressure_workload("pa", seed=1), pressure_workload("pb", seed=2)
    )
    real_release = GpuKvPool.release_pages

    def release_all_but_one(pool, uuid):
        if uuid != "pa-r1":
            real_release(pool, uuid)

    monkeypatch.setattr(GpuKvPool, "release_pages", release_all_but_one)
    assert main(["validate", "--fail-fast", "--reports-dir", str(tmp_path / "reports")]) == 1
    fails = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL ")]
    assert len(fails) == 1 and re.fullmatch(
        r"FAIL pa legacy/plan: integrity check failed at step \d+: pa-r1: GPU page table != pool",
        fails[0],
    )


def test_fail_fast_on_a_sound_validation_runs_everything_and_passes(monkeypatch, tmp_path, capsys):
    use_workloads(
        monkeypatch, tmp_path, pressure_workload("pa", seed=1), pressure_workload("pb", seed=2)
    )
    assert main(["validate", "--fail-fast", "--json", "--reports-dir", str(tmp_path / "r")]) == 0
    report = one_json_object(capsys.readouterr().out)
    assert report["ok"] and report["failures"] == []
    assert [(run["workload"], run["role"]) for run in report["runs"]] == [
        (name, role)
        for role in ("legacy/plan", "plan/legacy", "plan/plan")
        for name in ("pa", "pb")
    ] + [("pa", "reference"), ("pb", "reference"), ("pb", "fresh")]


def test_fail_fast_is_documented_in_validate_help(capsys):
    assert main(["validate", "--help"]) == 0
    assert "--fail-fast" in capsys.readouterr().out
