"""``scripts/benchmarks/ab_timer.py``, the A/B timer every benchmark shares: the order variants
run in, the calls it times (on a fake clock: tests never time) and the ratios it takes."""

import importlib
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def ab_timer(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("benchmarks.ab_timer")


def fake_clock(step: int = 5):
    """A clock that advances ``step`` ns per read."""
    return iter(range(0, 10**6, step)).__next__


def test_rotated_turns_put_every_variant_in_every_position(ab_timer):
    orders = [ab_timer.in_turn("abc", repeat) for repeat in range(4)]
    assert orders == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_alternated_turns_reverse_every_other_repeat(ab_timer):
    orders = [ab_timer.in_turn("abc", repeat, rotate=False) for repeat in range(3)]
    assert orders == [list("abc"), list("cba"), list("abc")]


def test_interleaved_runs_keep_each_variants_results_in_repeat_order(ab_timer):
    calls = []

    def run(variant: str) -> str:
        calls.append(variant)
        return f"{variant}{len(calls)}"

    results = ab_timer.interleaved(("plan", "legacy"), 3, run, rotate=False)
    assert calls == ["plan", "legacy", "legacy", "plan", "plan", "legacy"]
    assert results == {
        "plan": ["plan1", "plan4", "plan5"],
        "legacy": ["legacy2", "legacy3", "legacy6"],
    }


def test_the_ratio_is_the_median_of_the_per_repeat_ratios(ab_timer):
    assert ab_timer.median_ratio([2.0, 9.0, 3.0], [1.0, 3.0, 3.0]) == (2.0, [2.0, 3.0, 1.0])
    with pytest.raises(ValueError):
        ab_timer.median_ratio([1.0, 2.0], [1.0])


def test_a_timed_call_reports_its_time_less_the_overhead_even_when_it_raises(ab_timer):
    times = []
    sink = lambda name, ns: times.append((name, ns))  # noqa: E731

    def fail():
        raise KeyError("x")

    assert ab_timer.timed_call("ok", lambda a, b=0: a + b, sink, fake_clock(), 2)(1, b=2) == 3
    with pytest.raises(KeyError):
        ab_timer.timed_call("fail", fail, sink, fake_clock(), 9)()
    assert times == [("ok", 3), ("fail", 0)]  # never below zero


def test_the_kv_ops_of_the_workers_path_object_are_timed_and_its_class_left_alone(ab_timer):
    kv_ops = importlib.import_module("benchmarks.kv_ops")  # its worker and request stream
    from batchgen.config import TINY_MODELS
    from batchgen.kv.gate import KvGateConfig
    from batchgen.kv.plan_path import PlanKvPath
    from batchgen.model.null_model import NullModel
    from batchgen.shadow.wiring import gated_worker

    cache, engine = kv_ops.configs("pressure", 8)
    worker = gated_worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=cache,
        engine_config=engine,
        kv_gate=KvGateConfig(path="plan"),
        kv_storage=False,
    )
    stream, ns_by_op = kv_ops.RequestStream("pressure", 0), dict.fromkeys(kv_ops.KV_OPS, 0)
    for _ in range(8):
        worker.add_request(stream.next())
    ab_timer.time_kv_ops(worker, ab_timer.adding_to(ns_by_op), fake_clock(), 0)
    worker.step()
    assert {"poll", "release", "evict", "migrate", "allocate"} <= set(vars(worker._kv))
    assert ns_by_op == {"poll": 0, "release": 0, "evict": 5, "migrate": 5, "alloc": 5}
    assert vars(PlanKvPath)["evict"].__qualname__ == "PlanKvPath.evict"
