"""The page-content oracle: a broken copy or write is one ``data`` divergence naming the request,
the page and the layer; a correct run logs none; the gate flag that turns it on."""

from __future__ import annotations

import pytest
from data_plane_bugs import (
    one_round_trip,
    runs_whose_destination_does_not_advance,
    writes_one_slot_late,
)

from batchgen.engine import kv_verify as verify_module
from batchgen.engine import worker as worker_module
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload
from batchgen.kv import copy_runs
from batchgen.kv.backends import CopyOp
from batchgen.kv.gate import GateError, KvGateConfig, gate_config
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker
from batchgen.state import Request
from compare import DivergenceRecord, is_sampled_step, read_log

LAYERS = (0, 1)  # the tiny model's


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def verified_worker(model, workload: Workload, log, **gate) -> tuple[Worker, list[CopyOp]]:
    """A worker under the page-content oracle, and the copies it issues, as the oracle sees them
    (the test reads back where each copy went)."""
    kv_gate = KvGateConfig(compare_log=str(log), verify="all", **gate)
    worker = gated_worker(
        model, cache_config=workload.cache, engine_config=workload.engine, kv_gate=kv_gate
    )
    copies, verify = [], worker.host_kv.on_copy
    worker.host_kv.on_copy = lambda op: (copies.append(op), verify(op))
    return worker, copies


def data_records(log) -> list[DivergenceRecord]:
    if not log.exists():
        return []
    return [r for r in read_log(log).records if isinstance(r, DivergenceRecord)]


def test_a_correct_run_logs_no_data_divergence_and_checks_every_landed_page(model, tmp_path):
    log = tmp_path / "log.jsonl"
    worker, copies = verified_worker(model, one_round_trip(), log)
    result = run_workload(worker, one_round_trip(), check_integrity=True)
    (load,) = [op for op in copies if op.kind == "load"]
    summary = worker.kv_verify.summary()
    assert (result.stats.evictions, result.stats.loads) == (1, 1)
    assert summary.divergences == {} and data_records(log) == []
    assert (load.uuid, summary.checked["load"]) == ("r1", len(load.dst_page_ids))
    assert summary.checked["append"] > 0
    assert summary.patterns == {"copy.store.consecutive": 1, "copy.load.consecutive": 1}


def test_a_copy_run_whose_destination_does_not_advance_is_one_data_divergence(
    model, tmp_path, monkeypatch
):
    monkeypatch.setattr(copy_runs, "pair_runs", runs_whose_destination_does_not_advance)
    log = tmp_path / "log.jsonl"
    worker, copies = verified_worker(model, one_round_trip(), log)
    run_workload(worker, one_round_trip())
    store, load = copies
    # r1's pages 2, 3, 4 went to host pages 0, 1, 2 all into host page 0 (host pages 1 and 2 kept
    # their zeros), and came back to the same GPU pages all into GPU page 2: pages 3 and 4 still
    # hold their own bytes, page 2 holds a zero page.
    assert (store.kind, store.src_page_ids, load.kind, load.dst_page_ids) == (
        "store",
        (2, 3, 4),
        "load",
        (2, 3, 4),
    )

    (record,) = data_records(log)
    assert (record.kind, record.op, record.diff["check"], record.diff["request"]) == (
        "data",
        "poll",
        "load",
        "r1",
    )
    assert record.field_paths == [f"requests[r1].gpu_pages[2].layers[{layer}]" for layer in LAYERS]
    assert worker.kv_verify.summary().divergences == {"load": 1}


def test_a_write_one_slot_late_is_one_data_divergence_of_the_flush(model, tmp_path, monkeypatch):
    monkeypatch.setattr(worker_module, "write_kvs", writes_one_slot_late)
    log = tmp_path / "log.jsonl"
    worker, _ = verified_worker(model, one_round_trip(), log)
    worker.add_request(Request(uuid="solo", prompt_ids=(5, 17, 42, 8, 99, 3), max_new_tokens=4))
    worker.step()  # prefill: 6 positions into GPU pages 0 and 1, pending
    worker.step()  # flush: written one slot late

    (record,) = data_records(log)
    assert (record.kind, record.op, record.step, record.diff["request"]) == (
        "data",
        "flush",
        1,
        "solo",
    )
    assert record.field_paths == [
        f"requests[solo].gpu_pages[{page}].layers[{layer}]" for page in (0, 1) for layer in LAYERS
    ]


def test_with_compare_mode_on_data_checks_are_in_the_run_summary_and_its_log(model, tmp_path):
    log = tmp_path / "log.jsonl"
    worker, _ = verified_worker(model, one_round_trip(), log, compare="log")
    result = run_workload(worker, one_round_trip())
    assert worker.kv_compare.verifier is worker.kv_verify
    assert result.compare_summary.data == worker.kv_verify.summary()
    (summary,) = read_log(log).records
    assert summary.data.checked["load"] == 3 and summary.data.divergences == {}


def test_sample_checks_the_appends_of_the_steps_compare_mode_samples(model, tmp_path, monkeypatch):
    workload = one_round_trip()
    steps_checked = []

    def recording(pool, appends):
        steps_checked.append(current.state.step)
        return real_expected_appends(pool, appends)

    real_expected_appends = verify_module.expected_appends
    monkeypatch.setattr(verify_module, "expected_appends", recording)
    steps_by_mode = {}
    for mode in ("all", "sample"):
        gate = KvGateConfig(
            compare_log=str(tmp_path / "log.jsonl"), verify=mode, compare_sample=0.5
        )
        current = gated_worker(
            model, cache_config=workload.cache, engine_config=workload.engine, kv_gate=gate
        )
        run_workload(current, workload)
        steps_by_mode[mode], steps_checked = steps_checked, []

    every = steps_by_mode["all"]
    assert steps_by_mode["sample"] == [step for step in every if is_sampled_step(0, step, 0.5)]
    assert 0 < len(steps_by_mode["sample"]) < len(every)


@pytest.mark.parametrize(
    ("environ", "cli", "message"),
    [
        ({"BATCHGEN_WORKER_KV_VERIFY": "sampel"}, None, "did you mean 'sample'"),
        ({"BATCHGEN_WORKER_KV_VERIFI": "all"}, None, "did you mean BATCHGEN_WORKER_KV_VERIFY"),
        ({}, {"verify": "every"}, "--kv-verify='every' is invalid"),
    ],
    ids=["bad_value", "typo_in_the_name", "bad_option"],
)
def test_a_bad_verify_setting_is_refused_naming_the_closest_valid_one(environ, cli, message):
    with pytest.raises(GateError, match=message):
        gate_config(environ, cli)


def test_verify_is_off_by_default_and_the_option_overrides_the_environment():
    assert gate_config({}).verify == "off"
    environ = {"BATCHGEN_WORKER_KV_VERIFY": "all"}
    assert gate_config(environ).verify == "all"
    assert gate_config(environ, {"verify": "sample"}).verify == "sample"


def test_a_worker_with_verify_off_has_no_oracle_and_watches_no_copy(model):
    worker = Worker(
        model,
        cache_config=one_round_trip().cache,
    )
    assert worker.kv_verify is None and worker.host_kv.on_copy is None
