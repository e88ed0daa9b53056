"""Validation's page-content checks: a broken copy fails a compare run with a data failure, every
copy pattern must be issued, and reports count data divergences as their own kind."""

from __future__ import annotations

import pytest
from data_plane_bugs import one_round_trip, runs_whose_destination_does_not_advance

from batchgen.kv import copy_runs
from batchgen.kv.copy_patterns import COPY_PATTERN_IDS, issuable_patterns
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import DIRECTIONS
from batchgen.validation.checks import copy_pattern_failures
from batchgen.validation.session import Session
from batchgen.validation.workers import VALIDATION_COPY_SPLIT
from compare import DataChecks, DivergenceRecord, RunSummary, aggregate, read_log
from compare.render import data_line, render_text


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def session(model, tmp_path) -> Session:
    return Session(model, "cpu", tmp_path / "log.jsonl", {}, None)


@pytest.mark.parametrize("direction", DIRECTIONS, ids=lambda d: d.role)
def test_a_copy_run_whose_destination_does_not_advance_fails_the_compare_run_with_one_data_line(
    model, tmp_path, monkeypatch, direction
):
    monkeypatch.setattr(copy_runs, "pair_runs", runs_whose_destination_does_not_advance)
    checking = session(model, tmp_path)
    checking.run_corpus(direction, [one_round_trip()])
    assert checking.failures == [
        f"round-trip {direction.role}: 1 data divergence (page bytes that did not survive a copy"
        " or write; load: 1); first: poll step 6, data at requests[r1].gpu_pages[2].layers[0],"
        " requests[r1].gpu_pages[2].layers[1]"
    ]


def test_a_correct_compare_run_checks_its_pages_and_fails_nothing(model, tmp_path):
    checking = session(model, tmp_path)
    checking.run_corpus(DIRECTIONS[1], [one_round_trip()])
    (summary,) = [r for r in read_log(checking.log).records if r.binding == "kv"]
    assert checking.failures == []
    assert summary.data.checked["load"] == 3 and summary.data.divergences == {}


def test_validation_splits_a_batch_of_eight_tiny_pages_on_two_threads():
    page_bytes = 8 * 2**10  # the tiny model's page of 16 tokens: 2 layers, K/V, 2 heads, 16 dims
    assert VALIDATION_COPY_SPLIT.threads_for(8 * page_bytes) == 2
    assert VALIDATION_COPY_SPLIT.threads_for(7 * page_bytes) == 1


def summary(patterns: dict[str, int], divergences: dict[str, int] | None = None) -> RunSummary:
    return RunSummary(
        binding="kv",
        run_id="run-1", workload="w", seed=0, authoritative="plan", shadow="legacy",
        steps_compared={"poll": 3}, divergences={}, harness_errors=0, compare_seconds=0.1,
        authoritative_seconds=1.0,
        data=DataChecks(
            checked={"load": 4, "append": 9}, divergences=divergences or {}, patterns=patterns,
            seconds=0.25,
        ),
    )  # fmt: skip


def data_record() -> DivergenceRecord:
    return DivergenceRecord(
        binding="kv",
        run_id="run-1", workload="w", seed=0, step=5, op="poll", authoritative="plan",
        shadow="legacy", kind="data", field_paths=["requests[r1].gpu_pages[2].layers[0]"],
        diff={}, exception=None, replay={}, created_at=0.0,
    )  # fmt: skip


def test_a_pattern_no_run_issued_is_a_failure_naming_it():
    issued = {pattern: 1 for pattern in COPY_PATTERN_IDS if pattern != "copy.load.split"}
    report = aggregate([summary(issued)])
    assert copy_pattern_failures(report, issuable_patterns(host_to_host=True)) == [
        "copy patterns: never issued: copy.load.split"
    ]
    every = {pattern: 2 for pattern in COPY_PATTERN_IDS}
    assert copy_pattern_failures(aggregate([summary(every)]), COPY_PATTERN_IDS) == []


def test_with_a_gpu_involved_no_split_is_required():
    assert issuable_patterns(host_to_host=False) == tuple(
        pattern for pattern in COPY_PATTERN_IDS if not pattern.endswith(".split")
    )
    unsplit = {pattern: 1 for pattern in issuable_patterns(host_to_host=False)}
    assert (
        copy_pattern_failures(aggregate([summary(unsplit)]), issuable_patterns(host_to_host=False))
        == []
    )


def test_reports_count_data_divergences_as_their_own_kind_with_the_checks_and_patterns():
    report = aggregate([data_record(), summary({"copy.store.single": 2}, {"load": 1})])
    assert report.kinds == (("data", 1),)
    assert (report.data_checked, report.data_patterns) == (
        (("append", 9), ("load", 4)),
        (("copy.store.single", 2),),
    )
    line = (
        "data oracle: 9 append, 4 load checked in 0.25 s, 1 data divergence; patterns issued:"
        " copy.store.single 2"
    )
    assert data_line(report) == line
    assert line in render_text(report, width=200)
