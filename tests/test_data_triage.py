"""Triage of a data divergence: replay says in one line why it cannot replay one, minimize shrinks
it by rerunning its workload with the page-content oracle on."""

from __future__ import annotations

import pytest
from data_plane_bugs import one_round_trip, runs_whose_destination_does_not_advance

from batchgen.cli import main
from batchgen.engine.runner import run_workload
from batchgen.engine.workloads import WorkloadRequest
from batchgen.exit_codes import EXIT_BAD_INPUT
from batchgen.kv import copy_runs
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker
from batchgen.triage.minimize import minimize_divergence
from batchgen.triage.regression import write_regression_into
from compare import DivergenceRecord, read_log


@pytest.fixture()
def data_log(tmp_path, monkeypatch):
    """A compare-mode log of the round trip under a copy bug: one data divergence, the workload
    read from a file (as minimize needs)."""
    monkeypatch.setattr(copy_runs, "pair_runs", runs_whose_destination_does_not_advance)
    workload = one_round_trip().model_copy(
        update={
            "requests": [
                *one_round_trip().requests,
                WorkloadRequest(uuid="r2", prompt_ids=[4, 4, 4], max_new_tokens=2, arrival_step=9),
            ]
        }
    )
    source = tmp_path / "round-trip.json"
    source.write_text(workload.model_dump_json())
    log = tmp_path / "log.jsonl"
    gate = KvGateConfig(compare="log", compare_log=str(log), verify="all")
    worker = gated_worker(
        load_model("tiny"), cache_config=workload.cache, engine_config=workload.engine,
        kv_gate=gate,
    )  # fmt: skip
    run_workload(worker, workload, source=str(source))
    worker.kv_compare.sink.close()
    return log


def test_replay_of_a_data_divergence_says_in_one_line_why_not_and_suggests_minimize(
    data_log, capsys
):
    assert main(["replay", str(data_log), "--index", "0"]) == EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0
    assert "is a data divergence (page bytes), which cannot be replayed from a record" in error
    assert "batchgen minimize LOG --index N" in error


def test_minimize_shrinks_a_data_divergence_to_the_requests_that_show_it_and_writes_its_test(
    data_log, tmp_path
):
    (record,) = [r for r in read_log(data_log).records if isinstance(r, DivergenceRecord)]
    result = minimize_divergence(record, max_tests=60)
    assert (result.signature.op, result.signature.kind, result.signature.field_paths) == (
        "poll",
        "data",
        ("requests[*].gpu_pages[*].layers[*]",),
    )
    assert [r.uuid for r in result.workload.requests] == ["r0", "r1"]
    assert result.stopped_by is None
    _, test_file = write_regression_into(tmp_path / "regression", result)
    namespace: dict = {"__file__": str(test_file)}
    exec(compile(test_file.read_text(), str(test_file), "exec"), namespace)
    (test,) = [f for name, f in namespace.items() if name.startswith("test_no_poll_data")]
    with pytest.raises(AssertionError):  # the copy bug is still in: the written test fails
        test(tmp_path / "run")
