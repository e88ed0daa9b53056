"""Validate's self-checks: every malformed plan of the catalog is refused naming its field with its
message, every corruption is caught by the integrity check, counters agree with outputs; and a
weakened safety net makes ``batchgen validate`` fail naming the self-check that caught it."""

from __future__ import annotations

import dataclasses

import pytest
from test_validation import one_json_object, pressure_workload, use_workloads

from batchgen.cli import main
from batchgen.config import TINY_MODELS
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.kv import plan_checks
from batchgen.kv.plan_checks import PlanRejected
from batchgen.model.null_model import NullModel
from batchgen.state import Phase
from batchgen.validation.plan_refusal import PlanRefusal, refusal_failure
from batchgen.validation.plan_refusals import PLAN_REFUSALS
from batchgen.validation.self_checks import (
    CORRUPTIONS,
    TOKENS_CHECK,
    corruption_failure,
    counter_failures,
    self_check_results,
    worker_mid_run,
)


def _validate_json(monkeypatch, tmp_path, capsys, *args: str) -> tuple[int, dict]:
    use_workloads(monkeypatch, tmp_path, pressure_workload("pa", seed=1))
    code = main(["validate", "--json", "--reports-dir", str(tmp_path / "reports"), *args])
    return code, one_json_object(capsys.readouterr().out)


# ---- the catalogs on sound code (each plan refusal is a test of tests/test_kv_apply.py) ----------
@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=[c.id for c in CORRUPTIONS])
def test_each_corruption_of_a_worker_mid_run_is_caught_by_its_integrity_check(corruption):
    worker = worker_mid_run()
    requests = worker.state.requests
    worker.check_integrity()
    corruption.corrupt(worker, requests["r1"], requests["r4"])
    with pytest.raises(AssertionError):
        worker.check_integrity()
    assert corruption_failure(corruption) is None


def test_the_integrity_run_stops_with_a_load_in_flight_beside_running_requests():
    worker = worker_mid_run()
    phases = {uuid: req.phase for uuid, req in worker.state.requests.items()}
    assert phases == {
        "r1": Phase.RUNNING, "r2": Phase.RUNNING, "r3": Phase.RUNNING, "r4": Phase.LOADING,
    }  # fmt: skip
    assert worker.state.step == 7 and worker.gpu_kv.free_pages() == 1


def test_self_check_ids_are_unique_and_every_one_passes_on_sound_code():
    results = list(self_check_results())
    ids = [check_id for check_id, _ in results]
    assert len(ids) == len(set(ids)) == len(PLAN_REFUSALS) + len(CORRUPTIONS)
    assert all(i.startswith("plan.") for i in ids[: len(PLAN_REFUSALS)])
    assert all(i.startswith("integrity.") for i in ids[len(PLAN_REFUSALS) :])
    assert [failure for _, failure in results if failure is not None] == []


def test_an_accepted_plan_is_a_failure_naming_the_check_and_the_plan():
    accepted = PlanRefusal(
        "plan.test", "a sound COMPLETE", lambda target: None, "PollPlan.uuids", "covers []"
    )
    assert refusal_failure(accepted) == (
        "self-check plan.test: a sound COMPLETE was accepted; PollPlan.uuids must refuse it"
    )


def test_a_plan_refused_with_another_message_is_a_failure_naming_both_refusals():
    unobserved = next(c for c in PLAN_REFUSALS if c.id == "plan.poll.unobserved")
    reworded = dataclasses.replace(unobserved, message="covers nothing")
    assert refusal_failure(reworded) == (
        "self-check plan.poll.unobserved: a poll that leaves an observed load out was refused as"
        " PollPlan.uuids: covers [], observed ['load3'], not as PollPlan.uuids: covers nothing"
    )


def test_a_plan_refused_by_something_else_than_the_plan_checks_is_a_failure():
    def crash(target):
        raise TypeError("'<=' not supported")

    crashing = PlanRefusal("plan.test", "a crash", crash, "PollPlan.uuids", "covers []")
    assert refusal_failure(crashing) == (
        "self-check plan.test: a crash raised TypeError: '<=' not supported instead of"
        " PlanRejected naming PollPlan.uuids"
    )


def test_a_run_whose_token_counter_disagrees_with_its_outputs_fails_the_counter_check():
    workload = pressure_workload("pa", seed=1)
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]), cache_config=workload.cache, engine_config=workload.engine,
        kv_storage=False,
    )  # fmt: skip
    result = run_workload(worker, workload)
    produced = sum(len(output.output_ids) for output in result.outputs.values())
    assert counter_failures("pa run", result) == [] and produced > 0
    stats = dataclasses.replace(result.stats, tokens_generated=produced + 1)
    assert counter_failures("pa run", dataclasses.replace(result, stats=stats)) == [
        f"self-check {TOKENS_CHECK}: pa run: stats.tokens_generated is {produced + 1} but its"
        f" outputs hold {produced} tokens"
    ]


# ---- a weakened safety net fails validate --------------------------------------------------------
def test_validate_counts_its_self_checks_in_its_json(monkeypatch, tmp_path, capsys):
    code, report = _validate_json(monkeypatch, tmp_path, capsys, "--fail-fast")
    total = len(PLAN_REFUSALS) + len(CORRUPTIONS) + 1
    assert code == 0 and report["self_checks"] == {"passed": total, "total": total, "failed": []}


def test_duplicate_ids_accepted_by_the_plan_checks_fail_validate_at_its_self_check(
    monkeypatch, tmp_path, capsys
):
    def ids_without_duplicate_check(field, item_field, uuids):
        if type(uuids) is not tuple:
            raise PlanRejected(field, "must be a tuple")

    monkeypatch.setattr(plan_checks, "_check_ids", ids_without_duplicate_check)
    code, report = _validate_json(monkeypatch, tmp_path, capsys, "--fail-fast")
    assert code == 1 and report["runs"] == []
    assert len(report["failures"]) == 1
    assert report["failures"][0].startswith(
        "self-check plan.ids.not_str: a poll naming its load by an id of a str subclass was"
        " accepted"
    )


def test_a_prefix_hit_check_blind_to_digests_fails_validate_at_its_self_check(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(plan_checks, "_check_cached", lambda target, field, page_ids, digests: None)
    code, report = _validate_json(monkeypatch, tmp_path, capsys, "--fail-fast")
    assert code == 1 and report["runs"] == []
    assert report["failures"] == [
        "self-check plan.alloc.shared_other_digest: a prefix hit sharing a page cached at another"
        " position was accepted; AllocPlan.grants[1].shared_page_ids must refuse it"
    ]


def test_an_integrity_check_blind_to_page_tables_fails_validate_naming_each_corruption(
    monkeypatch, tmp_path, capsys
):
    def pools_only(worker):
        owners = set(worker.state.requests)
        worker.gpu_kv.check_integrity(owners)
        worker.host_kv.check_integrity(owners)

    monkeypatch.setattr(Worker, "check_integrity", pools_only)
    code, report = _validate_json(monkeypatch, tmp_path, capsys)
    pools_catch = ("integrity.orphan_host_page", "integrity.shared_set_not_the_holders")
    blind = [
        f"self-check {c.id}: check_integrity accepted {c.meaning}"
        for c in CORRUPTIONS
        if c.id not in pools_catch  # the pools' own check catches those
    ]
    assert code == 1 and [f for f in report["failures"] if f.startswith("self-check")] == blind
    assert report["self_checks"]["failed"] == [c.id for c in CORRUPTIONS if c.id not in pools_catch]


def test_a_token_counter_off_by_one_per_step_fails_validate_at_the_counter_check(
    monkeypatch, tmp_path, capsys
):
    real_step = Worker.step

    def step_counting_one_more(worker):
        real_step(worker)
        worker.state.stats.tokens_generated += 1

    monkeypatch.setattr(Worker, "step", step_counting_one_more)
    code, report = _validate_json(monkeypatch, tmp_path, capsys, "--fail-fast")
    assert code == 1 and len(report["failures"]) == 1
    assert report["failures"][0].startswith(
        f"self-check {TOKENS_CHECK}: pa legacy/plan: stats.tokens_generated is "
    )
    assert report["self_checks"]["failed"] == [TOKENS_CHECK]


def test_validate_prints_how_many_self_checks_passed_and_each_failure(
    monkeypatch, tmp_path, capsys
):
    real_check_integrity = Worker.check_integrity

    def without_stray_append_check(worker):
        worker.kv_target().pending_appends.pop("ghost", None)
        real_check_integrity(worker)

    monkeypatch.setattr(Worker, "check_integrity", without_stray_append_check)
    use_workloads(monkeypatch, tmp_path, pressure_workload("pa", seed=1))
    assert main(["validate", "--fail-fast", "--reports-dir", str(tmp_path / "reports")]) == 1
    lines = capsys.readouterr().out.splitlines()
    total = len(PLAN_REFUSALS) + len(CORRUPTIONS)
    assert (
        f"self-checks: {total - 1} of {total} passed (plan refusals, integrity corruptions,"
        " counters)" in lines
    )
    assert [line for line in lines if line.startswith("FAIL ")] == [
        "FAIL self-check integrity.stray_append: check_integrity accepted a pending append of a"
        " request no longer live"
    ]
