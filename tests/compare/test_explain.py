"""A divergence explains itself: each differing field path with each side's value under its path's
name, runs of consecutive indices collapsed, long values cut with the count left out, escaped where
rendered; the reports list the field paths, with values, before the coverage."""

import json
import xml.etree.ElementTree as ET

import pytest
from deepdiff import DeepDiff

from compare import ShadowExecutor
from compare.canonical import Keyed
from compare.coverage import Outcome
from compare.diff import diff
from compare.errors import DivergenceError
from compare.explain import explain, explain_forms, explain_record, leaf_values, row_lines
from compare.html import PageBinding, render_html
from compare.records import DivergenceRecord, RunSummary
from compare.render import render_json, render_junit, render_markdown, render_text
from compare.report import aggregate

PLAN = {
    "pools": {"gpu": [{"page_ids": list(range(12, 24))}]},
    "requests": Keyed({"r1": {"phase": "running", "gpu_page_ids": [12, 13]}, "r2": {"n": 1}}),
    "note": "x" * 100,
}
LEGACY = {
    "pools": {"gpu": [{"page_ids": list(range(2, 14))}]},
    "requests": Keyed({"r1": {"phase": "swapped", "gpu_page_ids": [12, 14]}}),
    "note": "y" * 100,
}
CATALOG = (Outcome("alloc.fits", "alloc", "the pages fit"),)
ROWS = [
    f'note  plan: "{"x" * 59}... (+42 more chars)  legacy: "{"y" * 59}... (+42 more chars)',
    "pools.gpu[0].page_ids[0..11]  plan: [12, 13, 14, 15, 16, 17, 18, 19, ... (+4 more)]"
    "  legacy: [2, 3, 4, 5, 6, 7, 8, 9, ... (+4 more)]",
    "requests[r1].gpu_page_ids[1]  plan: 13  legacy: 14",
    'requests[r1].phase  plan: "running"  legacy: "swapped"',
    "requests[r2].n  plan: 1  legacy: (absent)",
]


def record(authoritative=PLAN, shadow=LEGACY, *, workload="smoke", run_id="run-a"):
    found = diff(authoritative, shadow)
    return DivergenceRecord(
        binding="kv",
        run_id=run_id, workload=workload, seed=0, step=3, op="alloc", authoritative="plan",
        shadow="legacy", kind="state", field_paths=list(found.paths), diff=found.detail,
        exception=None, replay={}, created_at=0.0,
    )  # fmt: skip


def summary(workload="smoke", run_id="run-a"):
    return RunSummary(
        binding="kv",
        run_id=run_id, workload=workload, seed=0, authoritative="plan", shadow="legacy",
        steps_compared={"alloc": 4}, divergences={"alloc": 1}, harness_errors=0,
        compare_seconds=0.1, authoritative_seconds=1.0,
    )  # fmt: skip


def test_each_differing_path_gets_both_values_under_the_paths_names_runs_collapsed_values_cut():
    assert [row.text for row in explain_forms(PLAN, LEGACY, ("plan", "legacy"))] == ROWS


def test_a_logged_record_explains_itself_as_the_live_comparison_did():
    assert [row.text for row in explain_record(record())] == ROWS


def test_a_whole_root_entry_as_deepdiffs_default_threshold_writes_it_is_read_too():
    left = {"a[0]": 1, "a[1]": 2, "b": "x"}
    right = {"c": 3}
    collapsed = DeepDiff(left, right, verbose_level=2)  # deepdiff's default threshold
    assert list(collapsed.to_dict()["values_changed"]) == ["root"]
    rows = explain(collapsed.to_dict(), ["a[0]", "a[1]", "b", "c"], "plan", "legacy")
    assert [row.text for row in rows] == [
        "a[0..1]  plan: [1, 2]  legacy: (absent)",
        'b  plan: "x"  legacy: (absent)',
        "c  plan: (absent)  legacy: 3",
    ]


def test_paths_holding_quotes_and_brackets_read_back_from_deepdiffs_keys():
    paths = ["requests[it's].phase", 'requests[say "hi"].phase', "requests[a'b\"c\\]].n"]
    detail = diff(dict.fromkeys(paths, 1), dict.fromkeys(paths, 2)).detail
    assert leaf_values(detail) == {path: (1, 2) for path in paths}


def test_paths_past_the_recorded_bound_are_rows_without_values_and_lists_say_how_many_more():
    found = diff({"pages": list(range(60))}, {"pages": [-1] * 60})
    [row] = explain(found.detail, found.paths, "plan", "legacy")
    assert row.text == (
        "pages[0..59]  plan: [0, 1, 2, 3, 4, 5, 6, 7, ... (+52 more)]"
        "  legacy: [-1, -1, -1, -1, -1, -1, -1, -1, ... (+52 more)]"
    )
    assert explain({}, ["x[1]", "x[2]", "y"], "plan", "legacy")[0].text == "x[1..2]"


def test_an_aa_comparison_names_the_shadow_apart():
    [row] = explain_forms({"n": 1}, {"n": 2}, ("plan", "plan"))
    assert row.text == "n  plan: 1  plan (shadow): 2"


def test_row_lines_bound_the_rows_and_count_the_rest():
    assert row_lines(explain_forms(PLAN, LEGACY, ("plan", "legacy")), 2) == [*ROWS[:2], "(+3 more)"]


def test_the_divergence_error_gives_each_paths_values():
    executor = ShadowExecutor(mode="raise")
    with pytest.raises(DivergenceError) as raised:
        executor.run_both(
            "alloc", 3, authoritative=lambda: PLAN, shadow=lambda fork: LEGACY,
            authoritative_path="plan", shadow_path="legacy",
        )  # fmt: skip
    assert str(raised.value).splitlines() == [
        "alloc step 3: state divergence, shadow 'legacy' vs authoritative 'plan'",
        *ROWS,
    ]


def test_the_text_report_lists_field_paths_with_values_before_the_coverage():
    text = render_text(aggregate([record(), summary()], CATALOG), width=200)
    assert text.index("By field path") < text.index("Decision coverage")
    assert "requests[r1].phase (smoke step 3)" in text
    assert '  plan: "running"' in text and '  legacy: "swapped"' in text


def test_the_markdown_report_puts_values_in_code_spans_with_pipes_and_backticks_escaped():
    evil = record({"n": "a|b`c"}, {"n": "d"})
    lines = render_markdown(aggregate([evil, summary()], CATALOG)).splitlines()
    values = '``n  plan: "a\\|b`c"  legacy: "d"``'
    row = f"| alloc | `n` | 1 | 3 | smoke | state | {values} (smoke step 3) |"
    assert lines.index(row) < lines.index("| outcome | count | runs | first reached | note |")


def test_the_html_report_escapes_values_and_lists_field_paths_before_the_coverage():
    evil = record({"n": "<script>alert(1)</script>"}, {"n": "&"})
    logs = [("x.jsonl", [evil, summary()])]
    binding = PageBinding("t", (), {}, "tool replay {log} --index {index}")
    source = render_html(aggregate([evil, summary()], CATALOG), logs, binding)
    assert "<script>" not in source
    assert (
        "n  plan: &quot;&lt;script&gt;alert(1)&lt;/script&gt;&quot;  legacy: &quot;&amp;&quot;"
        in (source)
    )
    headings = ["".join(h.itertext()) for h in ET.fromstring(source).iter("h2")]
    assert headings.index("Divergences by field path") < headings.index("Decision coverage")


def test_the_junit_and_json_reports_carry_the_values_too():
    report = aggregate([record(), summary()], CATALOG)
    cases = {
        case.get("name"): case for case in ET.fromstring(render_junit(report)).iter("testcase")
    }
    lines = cases["smoke.alloc"].find("failure").text.splitlines()
    assert lines[lines.index("1 x requests[*].phase") + 1] == f"    {ROWS[3]}"
    [phase] = [
        p for p in json.loads(render_json(report))["paths"] if p["path"] == "requests[*].phase"
    ]
    assert phase["samples"][0]["rows"] == [
        {"path": "requests[r1].phase", "values": [["plan", '"running"'], ["legacy", '"swapped"']]}
    ]
