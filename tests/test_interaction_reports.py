"""Interactions in reports and in validate's verdict: counted like outcomes, reported apart, and a
reachable one no run reached fails the validation by name."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from batchgen.shadow.coverage import CATALOG
from batchgen.validation.checks import coverage_failures
from compare import OutcomeCount, RunSummary, aggregate
from compare.render import coverage_line, render_json, render_junit

REQUIRED = [o.id for o in CATALOG if o.unreachable is None]
INTERACTION = "evict.seq.host_3plus"


def summary_reaching(*outcomes: str) -> RunSummary:
    return RunSummary(
        binding="kv",
        run_id="r", workload="w", seed=0, authoritative="plan", shadow="legacy",
        steps_compared=dict.fromkeys(("poll", "release", "evict", "migrate", "alloc"), 1),
        divergences={}, harness_errors=0, compare_seconds=0.0, authoritative_seconds=0.0,
        coverage={outcome: OutcomeCount(count=1, first_step=0) for outcome in outcomes},
    )  # fmt: skip


def without(outcome: str):
    return aggregate([summary_reaching(*(o for o in REQUIRED if o != outcome))], CATALOG)


def test_a_validation_that_misses_a_reachable_interaction_fails_naming_it():
    assert coverage_failures(aggregate([summary_reaching(*REQUIRED)], CATALOG)) == []
    assert coverage_failures(without(INTERACTION)) == [
        f"interaction coverage: required interactions never reached: {INTERACTION}"
    ]


def test_an_interaction_the_catalog_rules_out_fails_the_validation_when_reached():
    ruled_out = "release.inflight_load_and_pending_append"
    report = aggregate([summary_reaching(*REQUIRED, ruled_out)], CATALOG)
    assert coverage_failures(report) == [
        "decision coverage: outcomes the catalog marks unreachable (or does not list) were "
        f"reached: {ruled_out}; the catalog's reason no longer holds"
    ]


def test_the_coverage_line_counts_outcomes_and_interactions_apart():
    num_outcomes = sum(1 for o in CATALOG if o.unreachable is None and o.kind == "outcome")
    num_interactions = len(REQUIRED) - num_outcomes
    assert coverage_line(without(INTERACTION)) == (
        f"decision coverage: {num_outcomes} of {num_outcomes} required outcomes reached; "
        f"interaction coverage: {num_interactions - 1} of {num_interactions} required "
        f"interactions reached; never reached: {INTERACTION}"
    )


def test_junit_has_a_failing_case_of_its_own_class_for_an_unreached_interaction():
    suite = ET.fromstring(render_junit(without(INTERACTION))).find("testsuite[@name='coverage']")
    failed = [case for case in suite if case.find("failure") is not None]
    assert [(c.get("classname"), c.get("name")) for c in failed] == [
        ("coverage.interaction", INTERACTION)
    ]
    assert suite.get("tests") == str(len(REQUIRED)) and suite.get("failures") == "1"


def test_the_json_report_rows_carry_each_ids_kind():
    rows = {
        row["outcome"]: row for row in json.loads(render_json(without(INTERACTION)))["coverage"]
    }
    assert (rows[INTERACTION]["kind"], rows[INTERACTION]["count"]) == ("interaction", 0)
    assert (rows["alloc.admit"]["kind"], rows["alloc.admit"]["count"]) == ("outcome", 1)
