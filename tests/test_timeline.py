"""The runner records a run's KV timeline (pages held and KV events per step): in the result, in
compare mode's run summary however the run ends, and in ``batchgen run --timeline FILE``."""

import json

import pytest
from injected_bugs import reversed_grants

from batchgen.cli import main
from batchgen.engine import runner
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import run_workload
from batchgen.engine.timeline import COUNTERS
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import load_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker
from compare import DivergenceError, DivergenceRecord, RunSummary, read_log

# on smoke, with no load retry: evictions, loads, failed loads and recomputes all happen
FAULTS = "seed=2,load_fail=0.7"


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def smoke_worker(model, *, gate=None, faults=FAULTS) -> tuple[Worker, object]:
    workload = load_workload("smoke", vocab_size=model.config.vocab_size)
    engine = workload.engine.model_copy(update={"max_load_retries": 0})
    injector = FaultInjector(FaultSpec.parse(faults)) if faults else None
    worker = gated_worker(
        model, cache_config=workload.cache, engine_config=engine,
        kv_gate=gate or KvGateConfig(), faults=injector,
    )  # fmt: skip
    return worker, workload


def test_the_timeline_holds_one_value_per_step_and_its_events_sum_to_the_runs_counters(model):
    worker, workload = smoke_worker(model)
    result = run_workload(worker, workload)
    timeline, stats = result.timeline, result.stats
    assert (timeline.first_step, timeline.num_steps) == (0, result.num_steps)
    assert list(timeline.counters) == list(COUNTERS)
    events = {name: sum(timeline.counters[name]) for name in COUNTERS[2:]}
    assert events == {
        "evictions": stats.evictions,
        "loads": stats.loads,
        "load_failures": stats.load_failures,
        "recomputes": stats.recompute_preemptions,
    }
    assert all(events.values()) and events["loads"] > events["load_failures"]
    assert max(timeline.counters["gpu_pages"]) == stats.peak_gpu_pages
    assert max(timeline.counters["host_pages"]) == stats.peak_host_pages
    assert (timeline.counters["gpu_pages"][-1], timeline.counters["host_pages"][-1]) == (0, 0)
    cache = workload.cache
    assert timeline.levels == {
        "gpu_capacity": cache.num_gpu_pages,
        "gpu_watermark": cache.num_gpu_pages - cache.watermark_pages,
        "host_capacity": cache.num_host_pages,
    }


def test_each_value_is_the_pools_after_its_step(model):
    worker, workload = smoke_worker(model)
    held = []  # on_step runs after each step
    result = run_workload(
        worker,
        workload,
        on_step=lambda done, total: held.append(
            (
                worker.gpu_kv.num_pages - worker.gpu_kv.free_pages(),
                worker.host_kv.num_pages - worker.host_kv.free_pages(),
            )
        ),
    )
    counters = result.timeline.counters
    assert list(zip(counters["gpu_pages"], counters["host_pages"])) == held


def test_back_to_back_runs_number_their_steps_as_the_worker_does(model):
    worker, workload = smoke_worker(model, faults=None)
    first = run_workload(worker, workload)
    worker.take_outputs()  # frees the uuids for the second run
    second = run_workload(worker, workload)
    assert second.timeline.first_step == first.num_steps == first.timeline.num_steps
    assert second.timeline.num_steps == second.num_steps


def test_compare_mode_writes_the_timeline_into_the_run_summary(model, tmp_path):
    log = tmp_path / "kv.jsonl"
    gate = KvGateConfig(compare="log", compare_log=str(log))
    worker, workload = smoke_worker(model, gate=gate)
    result = run_workload(worker, workload)
    worker.kv_compare.sink.close()
    [summary] = read_log(log).records
    assert summary.timeline == result.compare_summary.timeline == result.timeline


def test_a_run_stopped_by_a_divergence_logs_the_steps_before_it(model, tmp_path, monkeypatch):
    reversed_grants(monkeypatch)
    log = tmp_path / "kv.jsonl"
    gate = KvGateConfig(compare="raise", compare_log=str(log))
    worker, workload = smoke_worker(model, gate=gate, faults=None)
    with pytest.raises(DivergenceError):
        run_workload(worker, workload)
    worker.kv_compare.sink.close()
    [divergence, summary] = read_log(log).records
    assert isinstance(divergence, DivergenceRecord) and isinstance(summary, RunSummary)
    assert summary.stopped_by.startswith("DivergenceError")
    # the step that raised is not recorded: the timeline ends just before it
    assert summary.timeline.first_step + summary.timeline.num_steps == divergence.step


# ---- batchgen run --timeline -------------------------------------------------------------------
def test_run_writes_its_timeline_as_json(tmp_path, capsys):
    path = tmp_path / "timeline.json"
    flags = ["--faults", FAULTS, "--kv-load-retries", "0", "--timeline", str(path)]
    assert main(["run", "--workload", "smoke", "--json", *flags]) == 0
    summary = json.loads(capsys.readouterr().out)
    written = json.loads(path.read_text())
    assert (written["workload"], written["first_step"]) == ("smoke", 0)
    counters = written["counters"]
    assert {name: len(values) for name, values in counters.items()} == dict.fromkeys(
        COUNTERS, summary["steps"]
    )
    assert (sum(counters["evictions"]), sum(counters["loads"])) == (
        summary["evictions"],
        summary["loads"],
    )
    assert (sum(counters["load_failures"]), sum(counters["recomputes"])) == (
        summary["load_failures"],
        summary["recompute_preemptions"],
    )
    assert written["levels"]["gpu_capacity"] == 24


def test_a_stalled_run_still_writes_the_steps_it_ran(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "MAX_IDLE_STEPS", 300)
    path = tmp_path / "timeline.json"
    flags = ["--faults", "seed=1,gpu_refuse=1", "--timeline", str(path)]
    assert main(["run", "--workload", "smoke", *flags]) == 1
    counters = json.loads(path.read_text())["counters"]
    # every step stalled with every GPU page held by the fault
    assert counters["gpu_pages"] == [24] * 300


def test_run_refuses_a_timeline_that_is_the_divergence_log(tmp_path, capsys):
    log = str(tmp_path / "kv.jsonl")
    flags = ["--kv-compare", "log", "--kv-compare-log", log, "--timeline", log]
    assert main(["run", "--workload", "smoke", *flags]) == 2
    assert (
        f"--timeline {log}: it is the divergence log; name another file" in capsys.readouterr().err
    )
