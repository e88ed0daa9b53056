"""Compare mode's budget and breaker: the sample rate lowered to stay within a share of step time
(and raised again), compare mode turned off when its harness misbehaves, each change logged; with
neither set, a run logs exactly what it logged before they existed. Timing runs on a fake clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import load_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.model.null_model import NullModel
from batchgen.shadow.wiring import gated_worker
from compare import (
    BreakerWarning,
    CompareBreaker,
    CompareBudget,
    RunSummary,
    ShadowExecutor,
    is_sampled_step,
    read_log,
)
from compare.gates import BREAKER_DEFAULTS
from compare.records import SampleRateRecord

GOLDEN = Path(__file__).parent / "golden" / "smoke_reversed_grants.jsonl"
TIMES = ("created_at", "compare_seconds", "authoritative_seconds")  # differ run to run
MODEL_SECONDS = 0.010  # the fake time a step's own work takes
SHADOW_SECONDS = 0.001  # the fake time the slowed shadow path takes per op


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def long_smoke(tiny):
    """smoke's 16 requests (scale 2), one every 15 steps: a run of a few hundred steps."""
    workload = load_workload("smoke", scale=2, vocab_size=tiny.config.vocab_size)
    spaced = [
        r.model_copy(update={"arrival_step": 15 * i}) for i, r in enumerate(workload.requests)
    ]
    return workload.model_copy(update={"requests": spaced})


def slow_run(tiny, workload, gate: KvGateConfig, *, shadow_raises: bool = False):
    """``workload`` on a bookkeeping worker whose compare mode runs on a fake clock: each step's
    own work takes MODEL_SECONDS, each shadow op SHADOW_SECONDS (or raises inside the harness's
    fork, with ``shadow_raises``). Returns the result and the compare binding."""
    worker = gated_worker(
        NullModel(tiny.config), cache_config=workload.cache, engine_config=workload.engine,
        kv_gate=gate, kv_storage=False,
    )  # fmt: skip
    binding, clock = worker.kv_compare, FakeClock()
    binding.clock = clock
    shadow, fork = binding._run_shadow, binding._fork

    def slow_shadow(forked):
        clock.now += SHADOW_SECONDS
        return shadow(forked)

    def failing_fork():
        fork()
        raise OSError("the fork's allocator ran out")

    binding._run_shadow = slow_shadow
    if shadow_raises:
        binding._fork = failing_fork

    def on_step(num_released, num_requests):
        clock.now += MODEL_SECONDS

    return run_workload(worker, workload, on_step=on_step, run_id="run"), binding


def rate_records(log: Path) -> list[SampleRateRecord]:
    return [r for r in read_log(log).records if isinstance(r, SampleRateRecord)]


# ---- the budget --------------------------------------------------------------------------------
def test_a_step_over_the_budget_lowers_the_rate_to_three_quarters_of_the_budget():
    budget = CompareBudget(0.02, max_rate=1.0)
    # 5 ms of compare on 10 ms of work: unit cost 0.5, a share of 1/3 at rate 1
    change = budget.end_step(7, 0.015, 0.005, compared=True)
    assert (change.step, change.old_rate, change.cause) == (8, 1.0, "budget")
    assert change.new_rate == pytest.approx(0.015 / (0.5 * 0.985))
    assert change.share == pytest.approx(1 / 3)
    assert budget.expected_share(budget.rate) == pytest.approx(0.015)
    assert "over the budget 2.00%" in change.reason


def test_a_cheaper_compare_raises_the_rate_but_never_above_the_configured_sample():
    budget = CompareBudget(0.02, max_rate=0.5)
    budget.end_step(0, 0.015, 0.005, compared=True)
    lowered = budget.rate
    # compare got 1000x cheaper: the moving cost falls, the rate rises in steps up to the cap
    changes = [budget.end_step(step, 0.010005, 0.000005, compared=True) for step in range(1, 40)]
    raised = [change for change in changes if change is not None]
    assert [c.new_rate for c in raised] == sorted(c.new_rate for c in raised)
    assert raised[0].old_rate == lowered and raised[-1].new_rate == budget.rate == 0.5
    assert all("under half the budget" in c.reason for c in raised)


def test_steps_not_compared_change_nothing_but_the_totals():
    budget = CompareBudget(0.02, max_rate=1.0)
    assert budget.end_step(0, 0.010, 0.0, compared=False) is None
    assert (budget.rate, budget.unit, budget.share) == (1.0, None, 0.0)


def test_within_the_band_the_rate_stays():
    budget = CompareBudget(0.02, max_rate=1.0)
    budget.end_step(0, 0.015, 0.005, compared=True)
    rate = budget.rate
    assert budget.end_step(1, 0.015, 0.005, compared=True) is None  # same cost: share 1.5%
    assert budget.rate == rate


@pytest.mark.parametrize(("budget", "max_rate"), [(0.0, 1.0), (1.0, 1.0), (0.1, 0.0), (0.1, 1.5)])
def test_a_budget_outside_its_range_is_refused(budget, max_rate):
    with pytest.raises(ValueError, match="must be"):
        CompareBudget(budget, max_rate)


def test_with_a_two_percent_budget_a_slow_shadows_measured_share_ends_within_it(tiny, tmp_path):
    log = tmp_path / "log.jsonl"
    gate = KvGateConfig(compare="log", compare_log=str(log), compare_budget=0.02)
    result, binding = slow_run(tiny, long_smoke(tiny), gate)
    budget = binding.governor.budget
    assert budget.total_step_seconds == pytest.approx(binding.clock.now)  # every step measured
    summary = result.compare_summary
    assert budget.total_compare_seconds == pytest.approx(summary.compare_seconds)
    assert result.num_steps > 200
    assert budget.share <= 0.02
    changes = rate_records(log)
    assert changes[0].step == 1 and changes[0].old_rate == 1.0 and changes[0].cause == "budget"
    assert changes[0].new_rate < 0.1
    assert [c.old_rate for c in changes[1:]] == [c.new_rate for c in changes[:-1]]
    assert all(0 < c.new_rate <= 1.0 for c in changes)


def test_the_rate_changes_in_the_log_say_which_steps_were_compared(tiny, tmp_path, monkeypatch):
    compared: set[int] = set()
    run_both = ShadowExecutor.run_both

    def noting_run_both(self, op, step, **kwargs):
        compared.add(step)
        return run_both(self, op, step, **kwargs)

    monkeypatch.setattr(ShadowExecutor, "run_both", noting_run_both)
    log = tmp_path / "log.jsonl"
    gate = KvGateConfig(compare="log", compare_log=str(log), compare_budget=0.02)
    result, binding = slow_run(tiny, long_smoke(tiny), gate)
    changes = rate_records(log)
    # the steps the log's rates pick (by the run's seed) are the steps that were compared
    seed = result.compare_summary.seed
    steps = range(result.num_steps)
    assert compared == {s for s in steps if is_sampled_step(seed, s, _rate_at(changes, s))}
    assert len(compared) == binding.governor.num_compared_steps
    assert 1 < len(compared) < result.num_steps / 10


def _rate_at(changes: list[SampleRateRecord], step: int) -> float:
    """The sample rate at ``step``, by the log's rate changes (1.0 before the first). Pure."""
    rate = 1.0
    for change in changes:
        if change.step <= step:
            rate = change.new_rate
    return rate


# ---- the breaker -------------------------------------------------------------------------------
def test_the_breaker_counts_harness_errors_in_a_row_only():
    breaker = CompareBreaker(max_errors_in_row=3, max_op_seconds=None)
    assert [breaker.trip_reason(n, 0.0) for n in (1, 1, 0, 1, 1)] == [None] * 5
    assert breaker.trip_reason(2, 0.0) == "3 compared ops in a row had a harness error"


def test_the_breaker_trips_on_one_op_over_the_time_limit():
    breaker = CompareBreaker(max_errors_in_row=None, max_op_seconds=0.5)
    assert breaker.trip_reason(0, 0.5) is None
    assert "0.6 s of harness time, over the limit of 0.5 s" in breaker.trip_reason(0, 0.6)


def test_with_the_time_limit_hit_compare_turns_off_and_tokens_equal_a_run_without_it(
    tiny, tmp_path
):
    workload = long_smoke(tiny)
    log = tmp_path / "log.jsonl"
    gate = KvGateConfig(
        compare="log", compare_log=str(log), compare_breaker_seconds=SHADOW_SECONDS / 2
    )
    with pytest.warns(BreakerWarning, match="compare mode turned off from step 0"):
        result, binding = slow_run(tiny, workload, gate)
    plain = run_workload(
        Worker(NullModel(tiny.config), cache_config=workload.cache,
               engine_config=workload.engine, kv_storage=False),
        workload,
    )  # fmt: skip
    assert result.outputs == plain.outputs and result.num_steps == plain.num_steps
    summary = result.compare_summary
    assert summary.breaker_step == 0
    assert sum(summary.steps_compared.values()) == 1  # the op that tripped it, and no other
    (change,) = rate_records(log)
    assert (change.step, change.old_rate, change.new_rate, change.cause) == (0, 1.0, 0.0, "breaker")
    assert binding.executor.sample_rate == 0.0


@pytest.mark.filterwarnings("ignore::compare.errors.HarnessWarning")  # the failing fork's
def test_harness_errors_in_a_row_trip_the_breaker_and_the_summary_names_the_step(tiny, tmp_path):
    log = tmp_path / "log.jsonl"
    gate = KvGateConfig(compare="log", compare_log=str(log), compare_breaker_errors=4)
    with pytest.warns(BreakerWarning, match="4 compared ops in a row had a harness error"):
        result, _ = slow_run(tiny, long_smoke(tiny), gate, shadow_raises=True)
    summary = result.compare_summary
    assert summary.harness_errors == 4
    assert summary.breaker_step == 1  # smoke's first step has 3 KV ops; the 4th is step 1's first
    assert json.loads(log.read_text().splitlines()[-1])["breaker_step"] == 1


# ---- neither set -------------------------------------------------------------------------------
def _smoke_log(tiny, log: Path, gate: KvGateConfig) -> list[dict]:
    """smoke under faults with the demo switch's reversed grants in the shadow path: its log, times
    left out."""
    workload = load_workload("smoke", vocab_size=tiny.config.vocab_size)
    gate = gate.model_copy(update={"compare_demo_bug": "reversed-grants"})
    worker = gated_worker(
        tiny, cache_config=workload.cache, engine_config=workload.engine, kv_gate=gate,
        faults=FaultInjector(FaultSpec.parse("seed=2,load_fail=0.3")),
    )  # fmt: skip
    run_workload(worker, workload, run_id="golden")
    worker.kv_compare.sink.close()
    return [_untimed(json.loads(line)) for line in log.read_text().splitlines()]


def _untimed(record: dict) -> dict:
    return {key: value for key, value in record.items() if key not in TIMES}


def test_with_neither_budget_nor_breaker_the_log_is_the_golden_one(tiny, tmp_path):
    """The golden log is the demo switch's (``--kv-compare-demo-bug reversed-grants``), of schema
    2. Decision coverage, whose catalog grows, the schema version and fields added to the records
    after it (the binding) are left out of the comparison: every other field the golden log has is
    compared, times aside."""
    log = tmp_path / "log.jsonl"
    records = _smoke_log(tiny, log, KvGateConfig(compare="log", compare_log=str(log)))
    golden = [_untimed(json.loads(line)) for line in GOLDEN.read_text().splitlines()]
    assert [r["record_type"] for r in records] == ["divergence"] * 6 + ["run_summary"]
    assert {(r["schema_version"], r["binding"]) for r in records} == {(3, "kv")}
    assert "breaker_step" not in records[-1]
    left_out = ("coverage", "schema_version")
    kept = [{key: value for key, value in r.items() if key in g and key not in left_out}
            for r, g in zip(records, golden)]  # fmt: skip
    assert kept == [{key: value for key, value in g.items() if key not in left_out} for g in golden]


def test_a_breaker_that_never_trips_changes_no_record(tiny, tmp_path):
    plain, guarded = tmp_path / "plain.jsonl", tmp_path / "guarded.jsonl"
    gate = KvGateConfig(compare="log", compare_log=str(plain))
    with_breaker = gate.model_copy(update={"compare_log": str(guarded), **BREAKER_DEFAULTS})
    assert _smoke_log(tiny, plain, gate) == _smoke_log(tiny, guarded, with_breaker)
    assert RunSummary.model_fields["breaker_step"].default is None
