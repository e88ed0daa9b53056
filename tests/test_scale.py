"""Scale: a CPU-sized ``scripts/bench.py scale`` run keeps memory flat and the pools consistent.

512 live requests over 100,000 GPU pages for 150 steps, in plan and compare mode.
Each run is the benchmark's own child process (``--mode``): a fresh interpreter,
so the resident set it reads after ``gc.collect()`` at steps 50 and 150 is the
run's alone, not what earlier tests left in this process.
"""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import batchgen.engine.worker as worker_module
from batchgen.config import pages_needed
from batchgen.kv.gate import KvGateConfig

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
BENCH = SCRIPTS / "bench.py"
SMALL = ["--requests", "512", "--gpu-pages", "100000", "--steps", "150", "--rss-from-step", "50"]


def benchmark_module(name: str):
    """Import ``scripts/benchmarks/<name>.py`` (``scripts/`` on ``sys.path`` while it imports)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(f"benchmarks.{name}")
    finally:
        sys.path.remove(str(SCRIPTS))


scale_workload = benchmark_module("scale_workload")
scale_run = benchmark_module("scale_run")


def run_script(*args: str) -> subprocess.CompletedProcess:
    """``python scripts/bench.py scale ARGS`` in a child process."""
    return subprocess.run(
        [sys.executable, str(BENCH), "scale", *args], capture_output=True, text=True, timeout=300
    )


def test_the_workload_fills_the_gpu_pool_with_anchors_and_overcommits_the_room_they_leave():
    workload = scale_workload.pressure_workload(512, 100_000)
    cache = workload.cache
    anchors, crowd = workload.requests[:2], workload.requests[2:]
    assert (len(workload.requests), scale_workload.num_anchors(512)) == (512, 2)
    assert workload.engine.max_num_seqs == 512 and cache.num_host_pages == 100
    assert anchors[0].prompt_ids == anchors[1].prompt_ids
    usable = cache.num_gpu_pages - 2000  # watermark 0.02
    anchor_pages = sum(pages_needed(len(r.prompt_ids), cache.page_size) for r in anchors)
    crowd_pages_at_admission = sum(pages_needed(len(r.prompt_ids), cache.page_size) for r in crowd)
    assert 0.95 * usable < anchor_pages < usable - crowd_pages_at_admission
    assert all(1 <= len(r.prompt_ids) <= 8 and 16 <= r.max_new_tokens <= 80 for r in crowd)


def test_a_scale_run_refills_every_released_slot_and_keeps_the_pools_consistent():
    run = scale_run.ScaleRun(
        scale_workload.pressure_workload(64, 10_000), KvGateConfig(path="plan")
    )
    for _ in range(100):
        run.step()
        assert len(run.worker.state.requests) == 64
    assert run.num_finished > 64 and not run.worker.state.outputs  # drained, as a client would
    assert run.worker.state.stats.evictions > 0
    run.worker.check_integrity()


@pytest.mark.parametrize("mode", ["plan", "compare"])
def test_a_scale_run_times_the_kv_ops_and_the_scheduler_and_restores_what_the_worker_calls(
    mode, tmp_path
):
    originals = (worker_module.schedule, worker_module.observe_loads)
    compare = "off" if mode == "plan" else "log"
    gate = KvGateConfig(path="plan", compare=compare, compare_log=str(tmp_path / "log.jsonl"))
    run = scale_run.ScaleRun(scale_workload.pressure_workload(64, 10_000), gate)
    for _ in range(3):
        run.step()
    assert (worker_module.schedule, worker_module.observe_loads) == originals
    assert {"poll", "release", "evict", "migrate", "allocate"} <= set(vars(run.worker._kv))
    seconds = run.timer.seconds
    assert all(
        seconds[phase] > 0 for phase in ("evict", "migrate", "alloc", "schedule", "observe_loads")
    )
    assert sum(run.series.kv_s) == pytest.approx(run.timer.kv_seconds())


@pytest.mark.parametrize("mode", ["plan", "compare"])
def test_memory_stays_flat_over_150_steps_of_512_requests_under_pressure(mode, tmp_path):
    out = tmp_path / f"{mode}.json"
    proc = run_script("--mode", mode, *SMALL, "--json-out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    # Worker.check_integrity() after the last step: both pools, page tables
    assert result["integrity"] == "ok"
    assert result["num_steps"] == 150 and result["live_requests_end"] == 512
    assert min(result["evictions"], result["loads"], result["recompute_preemptions"]) > 0
    assert result["rss_ratio"] <= 1.05, result["rss_mib"]
    if mode == "compare":
        assert sum(result["compare"]["divergences"].values()) == 0
        assert result["compare"]["harness_errors"] == 0


def test_the_check_exits_1_and_says_fail_when_a_resident_set_ratio_is_over_the_limit():
    proc = run_script(
        "--modes",
        "plan",
        "--requests",
        "16",
        "--gpu-pages",
        "2000",
        "--steps",
        "20",
        "--rss-from-step",
        "10",
        "--max-rss-ratio",
        "0.5",
    )
    assert proc.returncode == 1, proc.stderr
    assert "verdict: FAIL plan" in proc.stdout
