"""Sweeps: the matrix and its order, one run as a task, the merged log on both backends, retries,
harness errors, Ctrl-C and the time budget.

Runs are ``smoke`` traces (a second each). The Ray tests share one local instance of 2 CPUs
(``ray_instance``), whose workers find this directory's task modules (``sweep_tasks``) on their
PYTHONPATH.
"""

import dataclasses
import json
import multiprocessing
import time
import xml.etree.ElementTree as ET
from functools import partial
from pathlib import Path

import pytest
from sweep_tasks import failing_run, num_attempts, run_with_reversed_grants

from batchgen.engine import runner
from batchgen.engine.faults import FaultSpecError
from batchgen.engine.workloads import builtin_workload
from batchgen.shadow.coverage import CATALOG
from batchgen.sweep.backends import WORKER_DIED, ProcessBackend, RayBackend
from batchgen.sweep.driver import SWEEP_REPORT_FILES, run_sweep
from batchgen.sweep.matrix import (
    SweepError,
    fault_schedule,
    run_cell,
    sweep_cells,
    sweep_directions,
    sweep_workloads,
)
from compare import DivergenceRecord, RunSummary, aggregate, parse_record, read_log

TIMINGS = ("created_at", "compare_seconds", "authoritative_seconds")


def smoke_cells(seeds=(0,), faults=(None,), serving="both", aa_check=False):
    return sweep_cells(
        sweep_workloads(["smoke"]),
        seeds,
        faults,
        sweep_directions(serving, aa_check=aa_check),
    )


def comparable(lines) -> list[dict]:
    """Log lines as dicts without the fields that time a run (they differ between two runs)."""
    return [
        {key: value for key, value in json.loads(line).items() if key not in TIMINGS}
        for line in lines
    ]


def log_lines(result) -> list[str]:
    return Path(result.reports["jsonl"]).read_text().splitlines()


def untimed(report):
    return dataclasses.replace(report, compare_seconds=0.0, authoritative_seconds=0.0)


# ---- the matrix --------------------------------------------------------------------------------
def test_the_matrix_runs_seeds_outermost_then_workloads_fault_schedules_and_directions():
    cells = sweep_cells(
        sweep_workloads(["smoke", "L2-2048"]),
        (4, 7),
        (None, "load_fail=0.5"),
        sweep_directions("both", aa_check=False),
    )
    assert [cell.label for cell in cells[:5]] == [
        "smoke seed 4 legacy/plan",
        "smoke seed 4 plan/legacy",
        "smoke seed 4 legacy/plan faults load_fail=0.5",
        "smoke seed 4 plan/legacy faults load_fail=0.5",
        "L2-2048 seed 4 legacy/plan",
    ]
    assert len(cells) == 16 and cells[8].label == "smoke seed 7 legacy/plan"


def test_max_runs_keeps_the_first_runs_of_the_matrix():
    workloads, directions = sweep_workloads(["smoke"]), sweep_directions("plan", aa_check=False)
    whole = sweep_cells(workloads, range(10), (None,), directions)
    assert sweep_cells(workloads, range(10), (None,), directions, max_runs=3) == whole[:3]


@pytest.mark.parametrize(
    "serving, aa_check, roles",
    [
        ("plan", False, ["plan/legacy"]),
        ("legacy", True, ["legacy/plan", "legacy/legacy"]),
        ("both", True, ["legacy/plan", "plan/legacy", "legacy/legacy", "plan/plan"]),
    ],
)
def test_directions_name_the_serving_paths_and_the_aa_check_adds_each_shadowed_by_itself(
    serving, aa_check, roles
):
    assert [d.role for d in sweep_directions(serving, aa_check=aa_check)] == roles


def test_a_run_id_is_a_digest_of_the_cell_and_a_files_content_not_its_path(tmp_path):
    text = builtin_workload("smoke", seed=3).model_copy(update={"name": "trace"}).model_dump_json()
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(text)
    plan = sweep_directions("plan", aa_check=False)
    cells_a = sweep_cells(sweep_workloads([str(tmp_path / "a.json")]), (0, 1), (None,), plan)
    cells_b = sweep_cells(sweep_workloads([str(tmp_path / "b.json")]), (0, 1), (None,), plan)
    assert [c.run_id for c in cells_a] == [c.run_id for c in cells_b]
    assert cells_a[0].run_id != cells_a[1].run_id
    assert cells_a[0].run_id.startswith("trace-") and len(cells_a[0].run_id) == len("trace-") + 16
    assert smoke_cells()[0].run_id == smoke_cells()[0].run_id


def test_a_fault_spec_without_a_seed_takes_the_runs_seed_and_one_with_a_seed_keeps_it():
    assert fault_schedule("load_fail=0.5", 7).startswith("seed=7,load_fail=0.5,")
    assert fault_schedule("seed=2, load_fail=0.5", 7).startswith("seed=2,load_fail=0.5,")
    assert fault_schedule(None, 7) is None
    with pytest.raises(FaultSpecError, match="load_fial"):
        smoke_cells(faults=("load_fial=0.5",))


def test_a_corpus_directory_gives_each_workload_file_in_it_by_name(tmp_path):
    for name in ("b", "a"):
        workload = builtin_workload("smoke", seed=1).model_copy(update={"name": f"w-{name}"})
        (tmp_path / f"{name}.json").write_text(workload.model_dump_json())
    (tmp_path / "notes.txt").write_text("not a workload")
    found = sweep_workloads([str(tmp_path), "smoke"])
    assert [w.name for w in found] == ["w-a", "w-b", "smoke"]
    assert found[0].source == str(tmp_path / "a.json") and found[2].content is None


@pytest.mark.parametrize(
    "specs, message",
    [
        (["smoke", "smoke"], "workload 'smoke' is in the sweep twice"),
        (["{empty}"], "a directory without workload files (*.json)"),
        (["{long}"], "exceeds the model's context of 4608 tokens (the sweep's model: tiny)"),
    ],
    ids=["named-twice", "empty-corpus", "request-the-model-cannot-serve"],
)
def test_a_matrix_that_cannot_be_swept_is_refused_naming_why(specs, message, tmp_path):
    (tmp_path / "empty").mkdir()
    long = builtin_workload("smoke").model_dump(mode="json")
    long["requests"][0]["max_new_tokens"] = 5000
    long["cache"]["num_gpu_pages"] = 2000
    (tmp_path / "long.json").write_text(json.dumps(long))
    paths = {"{empty}": str(tmp_path / "empty"), "{long}": str(tmp_path / "long.json")}
    with pytest.raises(SweepError) as error:
        sweep_workloads([paths.get(spec, spec) for spec in specs])
    assert message in str(error.value)


# ---- one run -----------------------------------------------------------------------------------
def test_run_cell_returns_the_runs_log_lines_ending_with_its_summary():
    cell = smoke_cells(seeds=(2,), faults=("load_fail=0.5",), serving="plan")[0]
    lines = run_cell(cell)
    summary = parse_record(lines[-1])
    assert isinstance(summary, RunSummary) and len(lines) == 1  # no divergence
    assert (summary.run_id, summary.workload, summary.seed) == (cell.run_id, "smoke", 2)
    assert (summary.authoritative, summary.shadow, summary.stopped_by) == ("plan", "legacy", None)
    assert summary.steps_compared["poll"] > 0


def test_a_run_that_stops_early_is_a_result_whose_summary_says_why(monkeypatch):
    monkeypatch.setattr(runner, "MAX_STEPS", 3)
    summary = parse_record(run_cell(smoke_cells(serving="plan")[0])[-1])
    assert summary.stopped_by.startswith("RunStalled: smoke: not done after 10 steps")


# ---- the merged log, on every backend ----------------------------------------------------------
def test_every_backend_and_number_of_workers_gives_the_same_merged_log(tmp_path, ray_instance):
    # four cells on two workers: each worker runs several, finishing out of order
    cells = smoke_cells(seeds=(0,), faults=(None, "load_fail=0.3,abort=0.05"))
    results = {}
    for name, backend in (("processes-2", ProcessBackend(2)), ("ray-2", RayBackend())):
        with backend:
            results[name] = run_sweep(
                cells, backend, run=run_with_reversed_grants, reports_dir=tmp_path / name
            )
    expected = comparable(line for cell in cells for line in run_with_reversed_grants(cell))
    records = [parse_record(line) for line in log_lines(results["ray-2"])]
    assert sum(isinstance(r, DivergenceRecord) for r in records) > 0
    assert [r.run_id for r in records if isinstance(r, RunSummary)] == [c.run_id for c in cells]
    for name, result in results.items():
        assert comparable(log_lines(result)) == expected, name
        assert untimed(result.compare) == untimed(aggregate(records, CATALOG)), name
        assert (result.num_done, result.num_retried, result.failures) == (4, 0, ()), name
        assert set(result.reports) == set(SWEEP_REPORT_FILES), name
        assert all(Path(path).exists() for path in result.reports.values()), name
    page = ET.parse(results["ray-2"].reports["html"]).getroot()
    charted = [s for s in page.iter("section") if s.get("class") == "run"]
    assert len(charted) == len(cells) and all(s.find("figure") is not None for s in charted)


@pytest.mark.parametrize("backend_name", ["processes", "ray"])
def test_a_task_whose_worker_is_killed_mid_run_is_retried_and_its_run_logged(
    backend_name, tmp_path, request
):
    cells = smoke_cells(serving="plan", aa_check=True)
    killed = cells[1].run_id
    run = partial(
        failing_run, marker_dir=str(tmp_path), run_ids=(killed,), num_failures=1, how="kill"
    )
    with _backend(backend_name, request) as backend:
        result = run_sweep(cells, backend, run=run, max_retries=1, reports_dir=tmp_path / "r")
    assert num_attempts(str(tmp_path), killed) == 2
    assert (result.ok, result.num_done, result.num_retried, result.failures) == (True, 2, 1, ())
    assert comparable(log_lines(result)) == comparable([*run_cell(cells[0]), *run_cell(cells[1])])


@pytest.mark.parametrize(
    "how, error",
    [
        ("kill", WORKER_DIED),
        ("raise", "RuntimeError: injected crash of attempt 3"),
    ],
    ids=["kill", "raise"],
)
@pytest.mark.parametrize("backend_name", ["processes", "ray"])
def test_a_task_that_fails_every_attempt_is_a_harness_error_naming_the_run(
    backend_name, how, error, tmp_path, request
):
    cells = smoke_cells(serving="plan", aa_check=True)
    lost = cells[0]
    run = partial(
        failing_run, marker_dir=str(tmp_path), run_ids=(lost.run_id,), num_failures=9, how=how
    )
    with _backend(backend_name, request) as backend:
        result = run_sweep(cells, backend, run=run, max_retries=2, reports_dir=tmp_path / "r")
    stopped_by = (
        f"harness error: the sweep's task failed in each of its 3 attempts; the last: {error}"
    )
    assert num_attempts(str(tmp_path), lost.run_id) == 3
    assert result.failures == (f"smoke seed 0 plan/legacy (run {lost.run_id}): {stopped_by}",)
    assert (result.ok, result.num_done, result.compare.num_harness_errors) == (False, 2, 1)
    records = read_log(result.reports["jsonl"]).records
    assert records[0] == RunSummary(
        binding="kv",
        run_id=lost.run_id,
        workload="smoke",
        seed=0,
        authoritative="plan",
        shadow="legacy",
        steps_compared={},
        divergences={},
        harness_errors=1,
        compare_seconds=0.0,
        authoritative_seconds=0.0,
        stopped_by=stopped_by,
    )
    assert comparable(log_lines(result)[1:]) == comparable(run_cell(cells[1]))


def _backend(name: str, request):
    if name == "ray":
        request.getfixturevalue("ray_instance")
        return RayBackend()
    return ProcessBackend(2)


# ---- stopping early ----------------------------------------------------------------------------
def test_ctrl_c_cancels_the_tasks_and_writes_a_whole_log_of_the_runs_that_finished(tmp_path):
    cells = smoke_cells(seeds=(0, 1, 2, 3))

    def interrupt_after_the_first_run(num_done, num_runs, num_divergences):
        raise KeyboardInterrupt

    with ProcessBackend(2) as backend:
        result = run_sweep(
            cells, backend, reports_dir=tmp_path, on_progress=interrupt_after_the_first_run
        )
    assert isinstance(result.interrupt, KeyboardInterrupt)
    assert (result.num_done, result.budget_spent) == (1, False)
    summaries = read_log(result.reports["jsonl"]).records
    assert len(summaries) == 1 and summaries[0].run_id in {cell.run_id for cell in cells}
    assert result.compare.num_runs == 1
    for process in multiprocessing.active_children():  # the run in flight was killed
        process.join(10)
        assert not process.is_alive()


def test_a_spent_time_budget_starts_no_run_and_writes_an_empty_log(tmp_path):
    with ProcessBackend(1) as backend:
        result = run_sweep(smoke_cells(), backend, reports_dir=tmp_path, deadline=time.monotonic())
    assert (result.ok, result.num_done, result.num_runs, result.budget_spent) == (False, 0, 2, True)
    assert Path(result.reports["jsonl"]).read_text() == ""
