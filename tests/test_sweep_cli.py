"""``batchgen sweep``: exit codes, what it prints and writes, on local processes and on a local Ray
instance it starts itself; Ray missing, a lost run, Ctrl-C.

(The matrix, the backends and the merged log are tested in test_sweep.py; bad flags in
bad_inputs.py.)
"""

import json
import re
import sys
from functools import partial

from sweep_tasks import failing_run, run_with_reversed_grants

from batchgen.cli import main
from batchgen.cli import sweep as sweep_command
from batchgen.sweep.backends import WORKER_DIED
from compare import DivergenceRecord, RunSummary, read_log

SMALL = ["sweep", "--workload", "smoke", "--seeds", "0-1", "--directions", "plan"]
REPORTS = (
    "divergences.jsonl",
    "divergences.md",
    "divergences.xml",
    "divergences.json",
    "report.html",
)


def test_sweep_on_local_processes_exits_0_and_writes_the_merged_log_and_every_report(
    tmp_path, capsys
):
    reports = tmp_path / "reports"
    argv = [*SMALL, "--aa", "--backend", "processes", "--num-cpus", "2"]
    assert main([*argv, "--reports-dir", str(reports)]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^batchgen sweep: PASSED: 4 of 4 runs in [\d.]+ s \([\d.]+ runs/min on processes, 2 at"
        r" once\); 0 divergences in \d+ compared ops$",
        out,
        re.MULTILINE,
    ), out
    summaries = read_log(reports / "divergences.jsonl").records
    assert [(s.seed, s.authoritative, s.shadow) for s in summaries] == [
        (0, "plan", "legacy"),
        (0, "plan", "plan"),
        (1, "plan", "legacy"),
        (1, "plan", "plan"),
    ]
    assert sorted(p.name for p in reports.iterdir()) == sorted([*REPORTS, "divergences.txt"])
    assert f"reports: {reports / 'divergences.jsonl'}, " in out


def test_sweep_on_a_local_ray_instance_of_2_cpus_prints_one_json_object(tmp_path, capsys):
    reports = tmp_path / "reports"
    argv = [*SMALL, "--backend", "ray", "--num-cpus", "2", "--reports-dir", str(reports)]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {key: result[key] for key in ("ok", "runs", "runs_done", "backend", "workers")} == {
        "ok": True,
        "runs": 2,
        "runs_done": 2,
        "backend": "ray",
        "workers": 2,
    }
    assert (result["divergences"], result["harness_errors"], result["failures"]) == (0, 0, [])
    assert len(read_log(reports / "divergences.jsonl").records) == 2


def test_a_sweep_with_divergences_exits_1_and_reports_them(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sweep_command, "run_cell", run_with_reversed_grants)
    reports = tmp_path / "reports"
    argv = [*SMALL, "--backend", "processes", "--num-cpus", "1", "--reports-dir", str(reports)]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "batchgen sweep: FAILED: 2 of 2 runs" in out
    records = read_log(reports / "divergences.jsonl").records
    assert {r.op for r in records if isinstance(r, DivergenceRecord)} == {"alloc"}
    assert (
        '<testcase classname="compare" name="smoke.alloc"><failure type="divergence"'
        in (reports / "divergences.xml").read_text()
    )


def test_a_run_lost_in_every_attempt_exits_1_naming_it_as_a_harness_error(
    tmp_path, capsys, monkeypatch
):
    cells = sweep_command.sweep_cells(
        sweep_command.sweep_workloads(["smoke"]),
        (0,),
        (None,),
        sweep_command.sweep_directions("plan", aa_check=False),
    )
    lost = cells[0].run_id
    run = partial(
        failing_run, marker_dir=str(tmp_path), run_ids=(lost,), num_failures=9, how="kill"
    )
    monkeypatch.setattr(sweep_command, "run_cell", run)
    argv = ["sweep", "--workload", "smoke", "--directions", "plan", "--backend", "processes"]
    reports = tmp_path / "reports"
    assert main([*argv, "--max-retries", "1", "--reports-dir", str(reports)]) == 1
    out = capsys.readouterr().out
    assert (
        f"FAIL smoke seed 0 plan/legacy (run {lost}): harness error: the sweep's task failed in"
        f" each of its 2 attempts; the last: {WORKER_DIED}\n"
    ) in out
    assert "1 harness error" in out
    (summary,) = read_log(reports / "divergences.jsonl").records
    assert isinstance(summary, RunSummary) and summary.harness_errors == 1


def test_ctrl_c_exits_130_after_writing_the_log_and_reports_of_the_runs_that_finished(
    tmp_path, capsys, monkeypatch
):
    def interrupting_callback(progress, num_runs):
        def on_progress(num_done, num_runs, num_divergences):
            raise KeyboardInterrupt

        return on_progress

    monkeypatch.setattr(sweep_command, "_progress_callback", interrupting_callback)
    reports = tmp_path / "reports"
    argv = [*SMALL, "--seeds", "0-5", "--backend", "processes", "--num-cpus", "2"]
    assert main([*argv, "--reports-dir", str(reports)]) == 130
    captured = capsys.readouterr()
    assert "batchgen sweep: INTERRUPTED: 1 of 6 runs" in captured.out
    assert captured.err.endswith("batchgen: interrupted\n")
    assert len(read_log(reports / "divergences.jsonl").records) == 1
    assert json.loads((reports / "divergences.json").read_text())["num_runs"] == 1


def test_without_ray_the_ray_backend_exits_2_saying_how_to_install_it(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert main([*SMALL, "--reports-dir", str(tmp_path / "reports")]) == 2
    assert capsys.readouterr().err == (
        "batchgen: error: --backend ray needs Ray, which is not installed: pip install"
        " 'batchgen[ray]' (or use --backend processes)\n"
    )


def test_sweep_help_explains_every_flag_with_its_default(capsys):
    assert main(["sweep", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    defaults = [
        ("--workload", "L2-2048 and L2-4096"),
        ("--seeds", "0"),
        ("--faults", "none"),
        ("--scale", "1.0"),
        ("--directions", "both"),
        ("--aa", "off"),
        (
            "--enable-prefix-caching",
            "$BATCHGEN_WORKER_KV_PREFIX_CACHE, on or off, else each workload's cache config",
        ),
        ("--max-runs", "all, at most 1000000"),
        ("--backend", "ray"),
        ("--ray-address", "start a local Ray instance of --num-cpus CPUs"),
        ("--num-cpus", "every CPU of the machine"),
        ("--max-retries", "3"),
        ("--time-budget", "none"),
        ("--reports-dir", "reports/sweep"),
        ("--metrics-port", "$BATCHGEN_METRICS_PORT, else none"),
        ("--metrics-host", "$BATCHGEN_METRICS_HOST, else 127.0.0.1"),
        ("--metrics-file", "$BATCHGEN_METRICS_FILE, else none"),
        ("--json", "off"),
    ]
    usage = text.partition("options:")[0]
    assert set(re.findall(r"\[(--[a-z-]+)", usage)) == {flag for flag, _ in defaults}
    for flag, default in defaults:
        assert re.search(f"{flag} .*?\\(default: {re.escape(default)}\\)", text), flag
