"""Back-to-back validation in compare mode: every direction, the A/A check, the reports, and each
failure it names.

The workloads are two small pressure traces (8 requests over 10 GPU pages of 4 tokens: eviction,
migration and recompute every few steps) given to the validation as workload files through
``BACK_TO_BACK_WORKLOADS``: the nine runs take seconds. ``make run`` runs the L2 traces.
"""

import dataclasses
import errno
import json
import random
import re
import xml.etree.ElementTree as ET

import pytest
from injected_bugs import reversed_grants

import batchgen.kv.manager as kv_manager
import batchgen.shadow.report_page
import batchgen.validation.session
import batchgen.validation.validate
from batchgen.cli import main
from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.workloads import Workload, WorkloadRequest
from batchgen.kv.backends import GpuKvPool
from batchgen.kv.plans import PollAction
from batchgen.model.loader import load_model
from batchgen.shadow.coverage import CATALOG
from batchgen.shadow.report_page import REPORT_FILES
from batchgen.shadow.wiring import DIRECTIONS
from batchgen.validation.checks import coverage_failures
from batchgen.validation.validate import validate_back_to_back
from compare import (
    DivergenceRecord,
    JsonlSink,
    LogWriteError,
    OutcomeCount,
    RunSummary,
    aggregate,
    read_log,
    write_atomic,
)

ROLES = [direction.role for direction in DIRECTIONS]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def pressure_workload(name: str, *, num_requests: int = 8, seed: int = 1) -> Workload:
    """Requests of 15-34 tokens over 10 GPU pages of 4 tokens (6 host pages): a lot of eviction."""
    rng = random.Random(seed)
    requests = [
        WorkloadRequest(
            uuid=f"{name}-r{i}",
            prompt_ids=[rng.randrange(1, 512) for _ in range(rng.randint(5, 14))],
            max_new_tokens=rng.randint(10, 20),
            arrival_step=i // 4,
        )
        for i in range(num_requests)
    ]
    cache = CacheConfig(page_size=4, num_gpu_pages=10, num_host_pages=6)
    return Workload(
        name=name, seed=seed, cache=cache, engine=EngineConfig(max_num_seqs=8), requests=requests
    )


def use_workloads(monkeypatch, tmp_path, *workloads: Workload, corpus=()) -> list[str]:
    """Make the validation run ``workloads`` (as files) back to back, then the ``corpus``
    workloads; their names. These tests judge the other checks on small workloads: the decision
    coverage they reach is not judged (test_coverage.py holds the corpus to it)."""
    paths = []
    for workload in workloads:
        path = tmp_path / f"{workload.name}.json"
        path.write_text(workload.model_dump_json())
        paths.append(str(path))
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for workload in corpus:
        (corpus_dir / f"{workload.name}.json").write_text(workload.to_json())
    monkeypatch.setattr(batchgen.validation.validate, "BACK_TO_BACK_WORKLOADS", tuple(paths))
    monkeypatch.setattr(batchgen.validation.validate, "CORPUS_DIR", corpus_dir)
    monkeypatch.setattr(batchgen.validation.validate, "coverage_failures", lambda report: [])
    # nor the copy patterns: their pages are too few to split a copy
    monkeypatch.setattr(
        batchgen.validation.validate, "copy_pattern_failures", lambda report, required: []
    )
    return [workload.name for workload in workloads]


@pytest.fixture
def two_pressure_workloads(monkeypatch, tmp_path):
    return use_workloads(
        monkeypatch, tmp_path, pressure_workload("pa", seed=1), pressure_workload("pb", seed=2)
    )


def one_json_object(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


# ---- a clean validation --------------------------------------------------------------------------
def test_validate_compares_both_directions_and_the_aa_check_and_finds_no_divergence(
    two_pressure_workloads, tmp_path, capsys
):
    reports = tmp_path / "reports"
    assert main(["validate", "--json", "--reports-dir", str(reports)]) == 0
    report = one_json_object(capsys.readouterr().out)
    assert (report["ok"], report["failures"], report["divergences"]) == (True, [], 0)
    assert report["workloads"] == ["pa", "pb"] and report["directions"] == [
        "legacy/plan",
        "plan/legacy",
        "plan/plan",
    ]
    assert sorted(report["steps_compared"]) == [
        "alloc",
        "evict",
        "finish",
        "migrate",
        "poll",
        "release",
    ]
    assert all(count > 0 for count in report["steps_compared"].values())
    assert report["divergences_by_op"] == dict.fromkeys(report["steps_compared"], 0)
    assert (report["leaked_gpu_pages"], report["leaked_host_pages"], report["harness_errors"]) == (
        0,
        0,
        0,
    )
    assert report["compare_overhead"] > 0
    runs = [
        (run["workload"], run["role"], run["kv_path"], run["shadow_path"]) for run in report["runs"]
    ]
    assert runs == [
        ("pa", "legacy/plan", "legacy", "plan"),
        ("pb", "legacy/plan", "legacy", "plan"),
        ("pa", "plan/legacy", "plan", "legacy"),
        ("pb", "plan/legacy", "plan", "legacy"),
        ("pa", "plan/plan", "plan", "plan"),
        ("pb", "plan/plan", "plan", "plan"),
        ("pa", "reference", "plan", None),
        ("pb", "reference", "plan", None),
        ("pb", "fresh", "plan", None),
    ]
    for run in report["runs"][:6]:
        assert (
            run["evictions"] > 0
            and run["divergences"] == 0
            and sum(run["steps_compared"].values()) > 0
        )
    assert report["reports"] == {kind: str(reports / name) for kind, name in REPORT_FILES.items()}


def test_validate_names_each_gate_variable_it_ignores_and_runs_its_own_gates(
    two_pressure_workloads, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_PATH", "legacy")
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE_LOG", str(tmp_path / "mine.jsonl"))
    assert main(["validate", "--json", "--reports-dir", str(tmp_path / "reports")]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("batchgen: warning:")]
    assert warnings == [
        "batchgen: warning: validate sets its own KV gates and ignores "
        f"BATCHGEN_WORKER_KV_PATH=legacy, BATCHGEN_WORKER_KV_COMPARE_LOG={tmp_path / 'mine.jsonl'} "
        "(batchgen run applies them)"
    ]
    report = one_json_object(captured.out)
    assert report["directions"] == ["legacy/plan", "plan/legacy", "plan/plan"] and report["ok"]
    assert not (tmp_path / "mine.jsonl").exists()


def test_validate_writes_the_log_and_four_reports_rendered_from_it(
    two_pressure_workloads, tmp_path, capsys
):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "divergences.jsonl").write_text("left over from an earlier run\n")
    assert main(["validate", "--reports-dir", str(reports)]) == 0
    summaries = read_log(reports / "divergences.jsonl").records
    assert all(isinstance(record, RunSummary) for record in summaries)
    assert [(s.binding, s.workload, s.authoritative, s.shadow) for s in summaries] == [
        (binding, f"{name} {role}", *role.split("/"))
        for role in ROLES
        for name in ("pa", "pb")
        for binding in ("finish", "kv")  # the finish step's run closes first
    ]
    assert (reports / "divergences.md").read_text().startswith("### 0 divergences in ")
    suite = ET.parse(reports / "divergences.xml").getroot().find("testsuite")
    assert suite.get("failures") == "0" and int(suite.get("tests")) == 6 * 6  # 5 KV ops, finish
    data = json.loads((reports / "divergences.json").read_text())
    assert data["num_divergences"] == 0
    page = ET.parse(reports / "report.html").getroot()
    runs = [section for section in page.iter("section") if section.get("class") == "run"]
    assert ["".join(run.find("h3").itertext()) for run in runs] == [
        f"{name} {role}" for role in ROLES for name in ("pa", "pb") for _ in ("finish", "kv")
    ]
    # the KV runs' timelines are charted; the finish step's runs have none
    svgs = [len(list(run.iter("{http://www.w3.org/2000/svg}svg"))) for run in runs]
    assert svgs == [0, 1] * 6
    [ops] = [table for table in page.iter("table") if table.get("id") == "ops"]
    assert [[td.text for td in row.findall("td")][:3] for row in ops.findall("tr")[1:]] == [
        [op["op"], str(op["num_compared"]), str(op["num_divergences"])] for op in data["ops"]
    ]
    [aa] = [p for p in page.iter("p") if p.get("id") == "aa"]
    assert aa.text.startswith("A/A noise check: 0 divergences in ")
    assert aa.text.endswith(" compared ops over 4 A/A runs (clean)")  # KV's and finish's
    assert not list(reports.glob(".*.tmp"))


def test_validate_prints_steps_compared_divergences_overhead_and_per_run_counters(
    two_pressure_workloads, tmp_path, capsys
):
    assert main(["validate", "--reports-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("batchgen validate: PASSED in ")
    assert re.search(
        r"^steps compared: alloc \d+, evict \d+, finish \d+, migrate \d+, poll \d+, release \d+$",
        out,
        re.M,
    )
    assert (
        "divergences: 0 (alloc 0, evict 0, finish 0, migrate 0, poll 0, release 0); harness errors:"
        " 0" in out
    )
    assert re.search(
        r"^compare overhead: [\d.]+ s of harness on [\d.]+ s in the authoritative path"
        r" \([\d.]+x the KV ops compared, not of the job\); "
        r"[\d.]+% of the compare runs' wall time$",
        out,
        re.M,
    )
    assert (
        "compare runs: workload, authoritative path, shadow path" in out
        and "reference and fresh runs" in out
    )
    assert "FAIL" not in out


def test_the_environment_gate_does_not_change_the_validation(
    two_pressure_workloads, model, monkeypatch
):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_PATH", "legacy")
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE", "raise")
    report = validate_back_to_back(model)
    assert report.ok, report.failures
    assert [(run.role, run.kv_path, run.shadow_path) for run in report.runs][6:] == [
        ("reference", "plan", None),
        ("reference", "plan", None),
        ("fresh", "plan", None),
    ]
    assert report.reports == {}  # no reports directory: the log lived in a temporary one


# ---- failures it names ---------------------------------------------------------------------------
def test_a_buggy_plan_method_fails_validation_naming_each_diverging_run(
    two_pressure_workloads, tmp_path, monkeypatch, capsys
):
    reversed_grants(monkeypatch)
    reports = tmp_path / "reports"
    assert main(["validate", "--reports-dir", str(reports)]) == 1
    fails = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL ")]
    assert len(fails) == 4, fails  # A/A: both sides run the same buggy plan path, so they agree
    for line, (name, direction) in zip(
        fails, [(n, d) for d in DIRECTIONS[:2] for n in ("pa", "pb")]
    ):
        assert re.fullmatch(
            rf"FAIL {name} {direction.role}: \d+ divergences of the {direction.shadow} shadow from"
            r" the authoritative "
            rf"{direction.authoritative} path \(alloc: \d+\); first: alloc step \d+, state at "
            rf"pools\.gpu\[\d+\]\.page_ids\[\d+\].*",
            line,
        )
    records = [
        r
        for r in read_log(reports / "divergences.jsonl").records
        if isinstance(r, DivergenceRecord)
    ]
    assert records and {r.op for r in records} == {"alloc"}
    assert {r.workload for r in records} == {
        f"{name} {d.role}" for d in DIRECTIONS[:2] for name in ("pa", "pb")
    }
    markdown = (reports / "divergences.md").read_text()
    assert (
        markdown.startswith(f"### {len(records)} divergences in ")
        and "`pools.gpu[*].page_ids[*]`" in markdown
    )
    suite = ET.parse(reports / "divergences.xml").getroot().find("testsuite")
    assert int(suite.get("failures")) == 4


def test_a_plan_the_applier_rejects_is_a_named_failure_not_a_crash(
    two_pressure_workloads, model, monkeypatch
):
    correct = kv_manager.KVCacheManager.plan_poll
    monkeypatch.setattr(
        kv_manager.KVCacheManager,
        "plan_poll",
        lambda self, req: dataclasses.replace(
            plan := correct(self, req), actions=(PollAction.RETRY,) * len(plan.uuids)
        ),
    )
    report = validate_back_to_back(model)
    assert not report.ok
    assert any(
        re.fullmatch(
            r"pa legacy/plan: \d+ divergences? of the plan shadow from the authoritative legacy "
            r"path \(poll: \d+\); first: poll step \d+, invalid_plan: plan raised PlanRejected: .*",
            failure,
        )
        for failure in report.failures
    ), report.failures
    assert any(
        re.fullmatch(r"pa plan/legacy: raised at step \d+: PlanRejected: .*", failure)
        for failure in report.failures
    ), report.failures
    # that worker stopped
    assert not any(failure.startswith("pb plan/legacy") for failure in report.failures)


def test_validation_fails_a_workload_that_never_evicted(model, monkeypatch, tmp_path):
    use_workloads(
        monkeypatch,
        tmp_path,
        pressure_workload("light", num_requests=1),
        pressure_workload("pb", seed=2),
    )
    progress = []
    report = validate_back_to_back(model, on_progress=lambda *update: progress.append(update))
    assert report.failures == [
        f"light {role}: never evicted to host (recompute preemptions: 0), so the run did not "
        "exercise the host tier; use a larger --scale"
        for role in ROLES
    ]
    assert [run.label for run in report.runs] == [
        "light legacy/plan",
        "pb legacy/plan",
        "light plan/legacy",
        "pb plan/legacy",
        "light plan/plan",
        "pb plan/plan",
        "light reference",
        "pb reference",
        "pb fresh",
    ]
    assert progress[-1] == ("pb fresh", 8, 8)


def test_an_interrupted_validation_leaves_the_last_log_and_reports_and_its_own_partial_log(
    two_pressure_workloads, tmp_path, capsys, monkeypatch
):
    reports = tmp_path / "reports"
    assert main(["validate", "--reports-dir", str(reports)]) == 0
    before = {path.name: path.read_bytes() for path in reports.iterdir()}
    calls = []

    def interrupted_on_the_third_run(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return session_run(self, *args, **kwargs)

    session_run = batchgen.validation.session.Session.run
    session = batchgen.validation.session.Session
    monkeypatch.setattr(session, "run", interrupted_on_the_third_run)
    assert main(["validate", "--reports-dir", str(reports)]) == 130
    assert capsys.readouterr().err.strip().endswith("batchgen: interrupted")
    after = {path.name: path.read_bytes() for path in reports.iterdir()}
    partial = after.pop("divergences.jsonl.partial")
    assert after == before
    assert [
        record.workload for record in read_log(reports / "divergences.jsonl.partial").records
    ] == ["pa legacy/plan"] * 2 + ["pb legacy/plan"] * 2 and partial  # the finish step's and KV's


def test_validation_reports_a_leak_in_every_direction_and_stops_each(
    model, two_pressure_workloads, monkeypatch
):
    real_release = GpuKvPool.release_pages

    def release_all_but_one(pool, uuid):
        if uuid != "pa-r1":
            real_release(pool, uuid)

    monkeypatch.setattr(GpuKvPool, "release_pages", release_all_but_one)
    report = validate_back_to_back(model)
    assert not report.ok and report.runs == ()
    assert len(report.failures) == 3
    for failure, role in zip(report.failures, ROLES):
        assert re.fullmatch(
            rf"pa {role}: integrity check failed at step \d+: pa-r1: GPU page table != pool",
            failure,
        )
    # one summary per run that broke off and slice (KV, finish), each saying why it stopped
    assert report.compare.num_runs == 6


def test_reports_a_full_disk_cannot_take_are_a_named_failure_and_the_summary_still_prints(
    two_pressure_workloads, tmp_path, capsys, monkeypatch
):
    def disk_full(path, text):
        if str(path).endswith(".xml"):
            raise OSError(errno.ENOSPC, "No space left on device")
        write_atomic(path, text)

    monkeypatch.setattr(batchgen.shadow.report_page, "write_atomic", disk_full)
    reports = tmp_path / "reports"
    assert main(["validate", "--json", "--reports-dir", str(reports)]) == 1
    report = one_json_object(capsys.readouterr().out)
    assert report["failures"] == [
        f"reports: cannot write {reports / 'divergences.xml'}: No space left on device"
    ]
    assert (report["divergences"], report["ok"]) == (0, False)
    assert sorted(path.name for path in reports.iterdir()) == [
        "divergences.jsonl",
        "divergences.md",
    ]


def test_a_divergence_log_whose_flush_fails_is_a_named_failure_of_its_direction(
    two_pressure_workloads, tmp_path, capsys, monkeypatch
):
    def flush_fails(self):  # the file is closed, as a failed fsync leaves it
        was_open = self._fd is not None
        close(self)
        if was_open:
            raise LogWriteError(self.path, OSError(errno.EIO, "Input/output error"))

    close = JsonlSink.close

    monkeypatch.setattr(JsonlSink, "close", flush_fails)
    reports = tmp_path / "reports"
    assert main(["validate", "--json", "--reports-dir", str(reports)]) == 1
    report = one_json_object(capsys.readouterr().out)
    partial = reports / "divergences.jsonl.partial"
    assert report["failures"] == [
        f"{role}: divergence log {partial}: a write failed: Input/output error" for role in ROLES
    ]


# ---- the corpus and decision coverage ----------------------------------------------------------
def test_the_corpus_runs_on_a_fresh_worker_in_every_direction_with_its_own_faults(
    monkeypatch, tmp_path, capsys
):
    corpus = pressure_workload("c0", seed=3).model_copy(update={"faults": "seed=2,load_fail=0.5"})
    use_workloads(monkeypatch, tmp_path, pressure_workload("pa"), corpus=[corpus])
    assert main(["validate", "--json", "--reports-dir", str(tmp_path / "reports")]) == 0
    report = one_json_object(capsys.readouterr().out)
    assert (report["workloads"], report["corpus"]) == (["pa"], ["c0"])
    corpus_runs = [run for run in report["runs"] if run["workload"] == "c0"]
    assert [run["role"] for run in corpus_runs] == ROLES
    assert all(run["load_failures"] > 0 and run["divergences"] == 0 for run in corpus_runs)


def summary_reaching(*outcomes: str) -> RunSummary:
    return RunSummary(
        binding="kv",
        run_id="r", workload="w", seed=0, authoritative="plan", shadow="legacy",
        steps_compared=dict.fromkeys(("poll", "release", "evict", "migrate", "alloc"), 1),
        divergences={}, harness_errors=0, compare_seconds=0.0, authoritative_seconds=0.0,
        coverage={outcome: OutcomeCount(count=1, first_step=0) for outcome in outcomes},
    )  # fmt: skip


def test_a_validation_that_misses_a_required_outcome_or_reaches_a_ruled_out_one_fails():
    required = [o.id for o in CATALOG if o.unreachable is None]
    everything = aggregate([summary_reaching(*required)], CATALOG)
    assert coverage_failures(everything) == []
    missing = aggregate([summary_reaching(*required[1:])], CATALOG)
    assert coverage_failures(missing) == [
        f"decision coverage: required outcomes never reached: {required[0]}"
    ]
    ruled_out = aggregate([summary_reaching(*required, "alloc.does_not_fit")], CATALOG)
    assert coverage_failures(ruled_out) == [
        "decision coverage: outcomes the catalog marks unreachable (or does not list) were "
        "reached: alloc.does_not_fit; the catalog's reason no longer holds"
    ]
