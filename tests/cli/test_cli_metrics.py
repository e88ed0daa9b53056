"""The command's metrics and production flags: ``--metrics-file`` after a run, the budget and
breaker options, the BATCHGEN_METRICS_* family, and the commands that refuse a budget or a
breaker (exit 2)."""

from __future__ import annotations

import json

import pytest
from cli_helpers import one_json_object, run_json
from prometheus_client.parser import text_string_to_metric_families

from batchgen.cli import main
from compare import BreakerWarning, RunSummary, read_log
from compare.records import SampleRateRecord


@pytest.fixture(autouse=True)
def no_metrics_environment(monkeypatch):
    for name in ("BATCHGEN_METRICS_PORT", "BATCHGEN_METRICS_HOST", "BATCHGEN_METRICS_FILE"):
        monkeypatch.delenv(name, raising=False)


def metric_values(path) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(path.read_text())
        for sample in family.samples
    }


def test_run_writes_the_final_metrics_equal_to_its_logs_summary(tmp_path, capsys):
    log, prom = tmp_path / "log.jsonl", tmp_path / "node" / "batchgen.prom"
    summary = run_json(
        capsys, "--kv-compare", "log", "--kv-compare-log", str(log), "--kv-compare-budget",
        "0.02", "--metrics-file", str(prom),
    )  # fmt: skip
    records = read_log(log).records
    (logged,) = [r for r in records if isinstance(r, RunSummary)]
    values = metric_values(prom)
    compared = {
        dict(labels)["op"]: value
        for (name, labels), value in values.items()
        if name == "batchgen:kv_compare_ops_total" and value
    }
    assert compared == {op: float(n) for op, n in logged.steps_compared.items()}
    smoke = (("workload", "smoke"),)
    assert values[("batchgen:generation_tokens_total", smoke)] == summary["tokens_generated"]
    assert values[("batchgen:evictions_total", smoke)] == summary["evictions"]
    # the rate the log's last change set is the rate the gauge ends at
    changes = [r for r in records if isinstance(r, SampleRateRecord)]
    final_rate = changes[-1].new_rate if changes else 1.0
    assert values[("batchgen:kv_compare_sample_rate", smoke)] == final_rate
    assert all(r.cause == "budget" and r.new_rate <= 1.0 for r in changes)


def test_the_breaker_options_reach_the_run_and_off_turns_it_off(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    # a limit no op can stay under: the first compared op trips it
    with pytest.warns(BreakerWarning, match="compare mode turned off from step 0"):
        assert main(
            ["run", "--workload", "smoke", "--json", "--kv-compare", "log", "--kv-compare-log",
             str(log), "--kv-compare-breaker-seconds", "1e-9"]
        ) == 0  # fmt: skip
    (change,) = [r for r in read_log(log).records if isinstance(r, SampleRateRecord)]
    assert (change.step, change.new_rate, change.cause) == (0, 0.0, "breaker")
    tripped = one_json_object(capsys.readouterr().out)
    assert (tripped["kv_breaker_step"], tripped["kv_sample_rate_end"]) == (0, 0.0)
    assert (tripped["kv_breaker_errors"], tripped["kv_breaker_seconds"]) == (
        10,
        1e-9,
    )
    untripped = run_json(
        capsys, "--kv-compare", "log", "--kv-compare-log", str(log),
        "--kv-compare-breaker-seconds", "off", "--kv-compare-breaker-errors", "off",
    )  # fmt: skip
    assert (untripped["kv_breaker_step"], untripped["kv_compare_budget"]) == (None, None)
    runs = [r for r in read_log(log).records if isinstance(r, RunSummary)]
    assert [run.breaker_step for run in runs] == [0, None]


@pytest.mark.parametrize(
    "argv",
    [
        ["validate"],
        ["explore", "--max-runs", "1"],
        ["sweep", "--backend", "processes"],
        ["minimize", "missing.jsonl", "--index", "0"],
    ],
)
@pytest.mark.parametrize(
    "variable",
    ["BATCHGEN_WORKER_KV_COMPARE_BUDGET", "BATCHGEN_WORKER_KV_COMPARE_BREAKER_ERRORS"],
)
def test_validation_commands_refuse_a_budget_or_a_breaker(argv, variable, monkeypatch, capsys):
    monkeypatch.setenv(variable, "3" if "ERRORS" in variable else "0.02")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"batchgen {argv[0]} compares every op it runs, so it refuses {variable}" in err


def test_a_misspelt_metrics_variable_exits_2_naming_the_closest(monkeypatch, capsys):
    monkeypatch.setenv("BATCHGEN_METRICS_FLIE", "m.prom")
    assert main(["run", "--workload", "smoke"]) == 2
    assert "did you mean BATCHGEN_METRICS_FILE?" in capsys.readouterr().err


def test_generate_writes_its_metrics_file(tmp_path, capsys):
    from test_cli_generate import completion, generate, write_input

    from batchgen.text.tiny_checkpoint import make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "ckpt")
    lines = [completion(f"c{i}", max_tokens=4 + i) for i in range(3)]
    prom = tmp_path / "generate.prom"
    code = generate(
        checkpoint, write_input(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl",
        "--kv-compare", "log", "--kv-compare-log", str(tmp_path / "log.jsonl"),
        "--metrics-file", str(prom),
    )  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    values = metric_values(prom)
    job = (("workload", "in.jsonl"),)
    assert values[("batchgen:generation_tokens_total", job)] == summary["tokens_generated"] > 0
    assert values[("batchgen:e2e_request_latency_seconds_count", job)] == 3
    assert values[("batchgen:time_to_first_token_seconds_count", job)] == 3
    assert values[("batchgen:prompt_tokens_total", job)] > 0
    compared = sum(v for (n, _), v in values.items() if n == "batchgen:kv_compare_ops_total")
    assert compared == summary["steps_compared"] > 0
