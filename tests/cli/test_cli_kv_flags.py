"""``batchgen run``'s KV flags over the ``BATCHGEN_WORKER_KV_*`` environment, compare mode, fault
injection and the load options, and how a run's requests ended."""

import json
import re

import pytest
from cli_helpers import TWO_REQUESTS, error_line, one_json_object, run_json
from injected_bugs import reversed_grants

from batchgen.cli import main
from batchgen.engine.workloads import builtin_workload
from batchgen.kv import manager as kv_manager
from batchgen.kv.gate import GATE_FLAGS
from batchgen.kv.plans import AllocPlan, PageGrant
from compare import DivergenceRecord, RunSummary, read_log


def test_the_environment_decides_when_an_option_is_absent(capsys, monkeypatch):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_PATH", "legacy")
    monkeypatch.setenv("BATCHGEN_WORKER_KV_LOAD_FAILURE", "fail")
    summary = run_json(capsys)
    assert (summary["kv_path"], summary["load_failure"]) == ("legacy", "fail")


def test_an_option_beats_the_environment(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_PATH", "legacy")
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE", "log")
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE_LOG", str(tmp_path / "env.jsonl"))
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE_OPS", "alloc,evict")
    summary = run_json(
        capsys,
        "--kv-path",
        "plan",
        "--kv-compare-log",
        str(tmp_path / "cli.jsonl"),
        "--kv-compare-ops",
        "alloc",
    )
    assert (summary["kv_path"], summary["kv_shadow_path"], summary["kv_compare"]) == (
        "plan",
        "legacy",
        "log",
    )
    assert (summary["kv_compare_ops"], list(summary["steps_compared"])) == (["alloc"], ["alloc"])
    assert summary["compare_log"] == str(tmp_path / "cli.jsonl")
    assert (tmp_path / "cli.jsonl").exists() and not (tmp_path / "env.jsonl").exists()


@pytest.mark.parametrize(
    "environment, message",
    [
        (
            {"BATCHGEN_WORKER_KV_PAHT": "plan"},
            (
                "batchgen: error: unknown variable BATCHGEN_WORKER_KV_PAHT (did you mean"
                " BATCHGEN_WORKER_KV_PATH?); valid names: "
                + ", ".join(sorted(env for env, _, _ in GATE_FLAGS.values()))
            ),
        ),
        (
            {"BATCHGEN_WORKER_KV_COMPARE": "yes"},
            (
                "batchgen: error: BATCHGEN_WORKER_KV_COMPARE='yes' is invalid (Input should be"
                " 'off', 'log' or 'raise'); allowed: off, log, raise"
            ),
        ),
    ],
    ids=["unknown-name", "bad-value"],
)
@pytest.mark.parametrize(
    "argv", [["run", "--workload", "smoke"], ["validate"]], ids=["run", "validate"]
)
def test_a_bad_gate_environment_exits_2_naming_the_variable(
    capsys, monkeypatch, environment, message, argv
):
    """``validate`` ignores the gates it is given, but a broken environment still stops it (before
    any model)."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    assert error_line(capsys) == message


def test_a_bad_gate_variable_is_refused_even_where_an_option_overrides_it(capsys, monkeypatch):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_PATH", "shadow")
    assert main(["run", "--workload", "smoke", "--kv-path", "plan"]) == 2
    assert (
        error_line(capsys)
        == "batchgen: error: BATCHGEN_WORKER_KV_PATH='shadow' is invalid (Input should be "
        "'plan' or 'legacy'); allowed: plan, legacy"
    )


def test_compare_settings_given_while_compare_is_off_are_named_in_a_warning(
    capsys, monkeypatch, tmp_path
):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE_OPS", "alloc")
    assert (
        main(
            ["run", "--workload", "smoke", "--json", "--kv-compare-log", str(tmp_path / "kv.jsonl")]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert (
        one_json_object(captured.out)["kv_compare"] == "off"
        and not (tmp_path / "kv.jsonl").exists()
    )
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert warnings == [
        "batchgen: warning: compare mode is off, so --kv-compare-log,"
        " BATCHGEN_WORKER_KV_COMPARE_OPS are ignored and no divergence log is written (--kv-compare"
        " log or raise turns it on)"
    ]


def test_a_compare_log_path_naming_a_file_that_is_no_log_exits_2_and_leaves_it(capsys, tmp_path):
    workload = tmp_path / "smoke.json"
    workload.write_text(builtin_workload("smoke", scale=0.25).model_dump_json())
    before = workload.read_bytes()
    assert (
        main(
            ["run", "--workload", "smoke", "--kv-compare", "log", "--kv-compare-log", str(workload)]
        )
        == 2
    )
    assert (
        error_line(capsys)
        == f"batchgen: error: {workload}: not a divergence log (its first line is no "
        "record), so nothing is appended to it; name a new file or an existing log"
    )
    assert workload.read_bytes() == before


def test_compare_mode_reports_steps_compared_per_op_and_divergences(capsys, tmp_path):
    log = tmp_path / "kv.jsonl"
    summary = run_json(
        capsys, "--kv-path", "legacy", "--kv-compare", "log", "--kv-compare-log", str(log)
    )
    assert (summary["kv_path"], summary["kv_shadow_path"], summary["compare_log"]) == (
        "legacy",
        "plan",
        str(log),
    )
    assert sorted(summary["steps_compared"]) == ["alloc", "evict", "migrate", "poll", "release"]
    assert all(count > 0 for count in summary["steps_compared"].values())
    assert (summary["divergences"], summary["divergences_by_op"], summary["harness_errors"]) == (
        0,
        {},
        0,
    )
    [record] = read_log(log).records
    assert isinstance(record, RunSummary) and record.steps_compared == summary["steps_compared"]


def test_compare_ops_and_sample_limit_what_is_compared(capsys, tmp_path):
    full = run_json(capsys, "--kv-compare", "log", "--kv-compare-log", str(tmp_path / "all.jsonl"))
    some = run_json(
        capsys,
        "--kv-compare",
        "log",
        "--kv-compare-log",
        str(tmp_path / "some.jsonl"),
        "--kv-compare-ops",
        "evict,alloc",
        "--kv-compare-sample",
        "0.5",
    )
    assert sorted(some["steps_compared"]) == ["alloc", "evict"]
    assert 0 < some["steps_compared"]["alloc"] < full["steps_compared"]["alloc"]


def test_compare_mode_divergences_are_counted_per_op_in_the_table(capsys, tmp_path, monkeypatch):
    reversed_grants(monkeypatch)
    log = tmp_path / "kv.jsonl"
    assert (
        main(["run", "--workload", "smoke", "--kv-compare", "log", "--kv-compare-log", str(log)])
        == 0
    )
    out = capsys.readouterr().out
    records = [r for r in read_log(log).records if isinstance(r, DivergenceRecord)]
    assert records
    assert re.search(rf"│ divergences +│ +{len(records)} │", out)
    assert re.search(rf"│ divergences_by_op +│ +alloc {len(records)} │", out)
    assert re.search(
        r"│ steps_compared +│ +alloc \d+, evict \d+, migrate \d+, poll \d+, release \d+ │", out
    )


def test_compare_mode_raise_stops_at_the_first_divergence_with_exit_1(
    capsys, tmp_path, monkeypatch
):
    reversed_grants(monkeypatch)
    log = tmp_path / "kv.jsonl"
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--kv-path",
                "legacy",
                "--kv-compare",
                "raise",
                "--kv-compare-log",
                str(log),
            ]
        )
        == 1
    )
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("batchgen:")]
    assert line.startswith(
        "batchgen: divergence: alloc step 0: state divergence, shadow 'plan' vs authoritative "
        "'legacy'; pools.gpu[0].page_ids[0..1]  legacy: [0, 1]  plan: [4, 3]; "
    )
    assert line.endswith(f"(compare log: {log})")
    record, summary = read_log(log).records  # the run still ends with its summary record
    assert (record.op, record.step) == ("alloc", 0)
    assert isinstance(summary, RunSummary) and summary.divergences == {"alloc": 1}


@pytest.mark.parametrize("compare", ["off", "log", "raise"])
def test_a_plan_the_plan_path_rejects_stops_the_run_with_exit_1(
    compare, capsys, monkeypatch, tmp_path
):
    correct = kv_manager.KVCacheManager.plan_allocation

    def one_page_too_many(self, req):
        plan = correct(self, req)
        return AllocPlan(
            tuple(PageGrant(g.uuid, (*g.new_page_ids, 10**6)) for g in plan.grants),
            plan.not_fitting,
        )

    monkeypatch.setattr(kv_manager.KVCacheManager, "plan_allocation", one_page_too_many)
    log = tmp_path / "kv.jsonl"
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--json",
                "--kv-compare",
                compare,
                "--kv-compare-log",
                str(log),
            ]
        )
        == 1
    )
    captured = capsys.readouterr()
    stopped = one_json_object(captured.out)
    assert (stopped["workload"], stopped["stopped"]) == ("smoke", "plan rejected")
    assert stopped["message"].startswith("AllocPlan.grants[0].new_page_ids: ")
    assert captured.err.strip().splitlines()[-1] == f"batchgen: plan rejected: {stopped['message']}"
    # logged as an invalid_plan divergence, and the run closed with its summary
    if compare != "off":
        assert stopped["message"].endswith(f"(compare log: {log})")
        record, summary = read_log(log).records
        assert record.kind == "invalid_plan" and summary.stopped_by.startswith("PlanRejected: ")


def test_faults_and_load_options_reach_the_worker(capsys):
    summary = run_json(
        capsys,
        "--faults",
        "seed=1,load_fail=1",
        "--kv-load-retries",
        "0",
        "--kv-load-failure",
        "fail",
        "--kv-load-timeout-steps",
        "3",
    )
    assert (
        summary["max_load_retries"],
        summary["load_timeout_steps"],
        summary["load_failure"],
    ) == (0, 3, "fail")
    assert (summary["faults"], summary["fault_aborts"]) == ("seed=1,load_fail=1", 0)
    # no retry: each fails
    assert 0 < summary["loads"] == summary["load_failures"] == summary["failed_requests"]
    retried = run_json(
        capsys,
        "--faults",
        "seed=1,load_fail=1",
        "--kv-load-retries",
        "2",
        "--kv-load-failure",
        "fail",
    )
    assert 0 < retried["load_failures"] == 3 * retried["failed_requests"]
    aborted = run_json(capsys, "--faults", "seed=3,abort=0.3")
    assert aborted["fault_aborts"] > 0 and aborted["failed_requests"] == 0
    assert aborted["aborted_requests"] == aborted["fault_aborts"]
    assert aborted["finished_requests"] == 8 - aborted["fault_aborts"]


def test_run_counts_its_requests_as_finished_aborted_and_failed(capsys, tmp_path):
    workload = tmp_path / "two.json"
    workload.write_text(json.dumps(TWO_REQUESTS))  # "b" is aborted at its abort_step
    assert main(["run", "--workload", str(workload), "--json"]) == 0
    summary = one_json_object(capsys.readouterr().out)
    assert list(summary)[:5] == [
        "workload",
        "requests",
        "finished_requests",
        "aborted_requests",
        "failed_requests",
    ]
    assert [summary[key] for key in list(summary)[1:5]] == [2, 1, 1, 0]
    assert main(["run", "--workload", str(workload)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"│ finished_requests +│ +1 │", out) and re.search(
        r"│ aborted_requests +│ +1 │", out
    )
    assert re.search(r"│ failed_requests +│ +0 │", out)


@pytest.mark.parametrize("output", [["--json"], []], ids=["json", "table"])
def test_a_run_where_requests_failed_warns_how_many_and_why_and_exits_0(output, capsys):
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--faults",
                "load_fail=1",
                "--kv-load-failure",
                "fail",
                *output,
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert warnings == [
        "batchgen: warning: 2 of 8 requests failed: load failed: LoadFault: injected load fail (2);"
        " the run still exits 0 (failed_requests counts them, --outputs names each)"
    ]
    if output:
        summary = one_json_object(captured.out)
        assert (
            summary["finished_requests"],
            summary["aborted_requests"],
            summary["failed_requests"],
        ) == (6, 0, 2)
    else:
        assert re.search(r"│ failed_requests +│ +2 │", captured.out)


def test_a_run_without_failed_requests_warns_nothing(capsys):
    assert main(["run", "--workload", "smoke", "--json", "--faults", "seed=3,abort=0.3"]) == 0
    assert "warning" not in capsys.readouterr().err
