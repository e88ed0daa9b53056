import re

import pytest
from test_gates import SchedulerGate

from compare import (
    DivergenceError,
    DivergenceRecord,
    Experiment,
    JsonlSink,
    Limits,
    RunSummary,
    SampleRateRecord,
    read_log,
)


def make(tmp_path, **options):
    options.setdefault("paths", ("planner", "legacy"))
    options.setdefault("log", tmp_path / "toy.jsonl")
    return Experiment("toy", workload="burst", seed=3, run_id="burst-1", **options)


def test_returns_the_authoritative_result_and_logs_a_divergence_naming_binding_and_run(tmp_path):
    experiment = make(tmp_path, replay=lambda comparison, context: {"input": context})
    result = experiment.run(
        "admit", 4, authoritative=lambda: ["r1"], shadow=lambda fork: ["r2"], context=lambda: 7
    )
    experiment.close()
    assert result == ["r1"]
    divergence, summary = read_log(tmp_path / "toy.jsonl").records
    assert isinstance(divergence, DivergenceRecord)
    assert (divergence.binding, divergence.run_id, divergence.workload, divergence.seed) == (
        "toy",
        "burst-1",
        "burst",
        3,
    )
    assert (divergence.op, divergence.step, divergence.field_paths) == ("admit", 4, ["[0]"])
    assert (divergence.authoritative, divergence.shadow, divergence.replay) == (
        "planner",
        "legacy",
        {"input": 7},
    )
    assert (summary.binding, summary.steps_compared, summary.divergences) == (
        "toy",
        {"admit": 1},
        {"admit": 1},
    )


def test_close_logs_one_summary_and_returns_it_again(tmp_path):
    experiment = make(tmp_path)
    experiment.run("admit", 0, authoritative=lambda: 1, shadow=lambda fork: 1)
    first = experiment.close()
    assert experiment.close() is first
    assert read_log(tmp_path / "toy.jsonl").records == (first,)
    assert (first.steps_compared, first.divergences, first.harness_errors) == ({"admit": 1}, {}, 0)


def test_ops_the_sample_leaves_out_run_the_authoritative_path_alone(tmp_path):
    called = []
    experiment = make(tmp_path, ops=("preempt",), fork=lambda: called.append("fork"))
    result = experiment.run(
        "admit",
        0,
        authoritative=lambda: "served",
        shadow=lambda fork: called.append("shadow"),
        context=lambda: called.append("context"),
    )
    assert (result, called) == ("served", [])
    assert experiment.close().steps_compared == {}


def test_outcomes_see_the_context_and_both_paths_observations(tmp_path):
    seen = []

    def outcomes(op, context, authoritative, shadow):
        seen.append((op, context, authoritative.path, authoritative.value, shadow.value))
        return [f"{op}.fits"]

    experiment = make(tmp_path, outcomes=outcomes)
    experiment.run(
        "admit", 2, authoritative=lambda: 5, shadow=lambda fork: 5, context=lambda: "ctx"
    )
    assert seen == [("admit", "ctx", "planner", 5, 5)]
    assert experiment.close().coverage["admit.fits"].first_step == 2


def test_the_shadow_runs_on_what_fork_returns(tmp_path):
    experiment = make(tmp_path, fork=lambda: {"queue": [1]})
    experiment.run("admit", 0, authoritative=lambda: [1], shadow=lambda fork: fork["queue"])
    assert experiment.close().divergences == {}


def test_raise_mode_raises_the_divergence(tmp_path):
    experiment = make(tmp_path, mode="raise")
    with pytest.raises(DivergenceError, match="^admit step 0: state divergence"):
        experiment.run("admit", 0, authoritative=lambda: 1, shadow=lambda fork: 2)


def test_a_default_run_id_is_the_workload_and_eight_hex_digits(tmp_path):
    experiment = Experiment("toy", paths=("a", "b"), log=tmp_path / "toy.jsonl", workload="w")
    assert re.fullmatch(r"w-[0-9a-f]{8}", experiment.run_id)
    assert Experiment("toy", paths=("a", "b"), log=tmp_path / "x.jsonl").key.workload == "toy"


def test_a_block_that_raises_closes_the_run_naming_why(tmp_path):
    with pytest.raises(KeyError), make(tmp_path) as experiment:
        raise KeyError("r9")
    assert experiment.summary.stopped_by == "KeyError: 'r9'"
    assert read_log(tmp_path / "toy.jsonl").records == (experiment.summary,)


def test_a_shared_log_stays_open_for_the_next_run(tmp_path):
    with JsonlSink(tmp_path / "shared.jsonl") as sink:
        for run_id in ("one", "two"):
            Experiment("toy", paths=("a", "b"), log=sink, run_id=run_id).close()
        assert sink._fd is not None
    records = read_log(tmp_path / "shared.jsonl").records
    assert [(type(r), r.run_id) for r in records] == [(RunSummary, "one"), (RunSummary, "two")]


def test_each_logged_record_goes_to_on_record(tmp_path):
    logged = []
    experiment = make(tmp_path, on_record=logged.append)
    experiment.run("admit", 0, authoritative=lambda: 1, shadow=lambda fork: 2)
    summary = experiment.close()
    assert [type(r) for r in logged] == [DivergenceRecord, RunSummary] and logged[1] is summary


def test_a_breaker_turns_compare_off_and_logs_the_change_under_the_binding(tmp_path):
    def broken(seen, shadow_seen):
        raise RuntimeError("no form")

    experiment = make(tmp_path, canonicalize=broken, limits=Limits(max_errors_in_row=1))
    with pytest.warns(RuntimeWarning):
        experiment.run("admit", 5, authoritative=lambda: 1, shadow=lambda fork: 1)
    assert experiment.close().breaker_step == 5
    change = read_log(tmp_path / "toy.jsonl").records[0]
    assert isinstance(change, SampleRateRecord)
    assert (change.binding, change.step, change.new_rate, change.cause) == (
        "toy",
        5,
        0.0,
        "breaker",
    )


def test_from_gate_takes_the_gates_paths_log_mode_sample_ops_and_limits(tmp_path):
    gate = SchedulerGate(
        path="legacy",
        compare="raise",
        compare_sample=0.5,
        compare_log=str(tmp_path / "gate.jsonl"),
        compare_ops="preempt",
        compare_breaker_errors=2,
    )
    experiment = Experiment.from_gate("toy", gate, seed=1)
    assert (experiment.authoritative_path, experiment.shadow_path) == ("legacy", "planner")
    assert experiment.sink.path == tmp_path / "gate.jsonl"
    assert experiment.executor.sample_rate == 0.5
    assert experiment.governor.breaker.max_errors_in_row == 2
    assert not experiment.executor.should_compare("admit", 0)
    with pytest.raises(DivergenceError):
        experiment.run("preempt", 0, authoritative=lambda: 1, shadow=lambda fork: 2)
