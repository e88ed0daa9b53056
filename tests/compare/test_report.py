import json
import re
import xml.etree.ElementTree as ET
from dataclasses import astuple

from compare.explain import Row
from compare.records import DivergenceRecord, RunSummary
from compare.render import headline, render_json, render_junit, render_markdown, render_text
from compare.report import MAX_SAMPLES, OpStats, PairStats, PathSample, aggregate


def divergence(step, paths, *, op="alloc", workload="L2-2048", run_id="run-a", kind="state"):
    return DivergenceRecord(
        binding="kv",
        run_id=run_id,
        workload=workload,
        seed=0,
        step=step,
        op=op,
        authoritative="plan",
        shadow="legacy",
        kind=kind,
        field_paths=paths,
        diff={},
        exception=None,
        replay={},
        created_at=0.0,
    )


def summary(workload, run_id, steps_compared, *, harness_errors=0):
    return RunSummary(
        binding="kv",
        run_id=run_id,
        workload=workload,
        seed=0,
        authoritative="plan",
        shadow="legacy",
        steps_compared=steps_compared,
        divergences={},
        harness_errors=harness_errors,
        compare_seconds=1.0,
        authoritative_seconds=4.0,
    )


RECORDS = [
    divergence(5, ["requests[r17].gpu_pages[3]", "requests[r17].gpu_pages[4]"]),
    divergence(9, ["requests[r4].gpu_pages[0]", "free_pages[2]"]),
    divergence(2, ["requests[r8].gpu_pages[1]"], workload="L2-4096", run_id="run-b"),
    divergence(30, [], op="evict", workload="L2-4096", run_id="run-b", kind="exception"),
    summary("L2-2048", "run-a", {"alloc": 100, "evict": 20}),
    summary("L2-4096", "run-b", {"alloc": 200, "evict": 50, "migrate": 10}, harness_errors=2),
]


def test_totals_compared_steps_divergences_runs_and_harness_errors():
    report = aggregate(RECORDS)
    assert (report.num_runs, report.num_compared, report.num_divergences) == (2, 380, 4)
    assert report.num_harness_errors == 2
    assert (report.compare_seconds, report.authoritative_seconds) == (2.0, 8.0)


def test_counts_compared_steps_and_divergences_per_op():
    assert aggregate(RECORDS).ops == (
        OpStats("alloc", 300, 3),
        OpStats("evict", 70, 1),
        OpStats("migrate", 10, 0),
    )


def test_counts_each_divergence_once_per_wildcarded_field_path():
    [pages, free, exception] = aggregate(RECORDS).paths
    assert (pages.op, pages.path, pages.count) == ("alloc", "requests[*].gpu_pages[*]", 3)
    assert (pages.first_step, pages.last_step) == (2, 9)
    assert (pages.workloads, pages.kinds) == (("L2-2048", "L2-4096"), ("state",))
    # each sample holds the record's rows under the path (no values: these records' diff is {})
    assert pages.samples == (
        PathSample("run-a", "L2-2048", 5, "requests[r17].gpu_pages[3]",
                   (Row("requests[r17].gpu_pages[3..4]", ()),)),
        PathSample("run-a", "L2-2048", 9, "requests[r4].gpu_pages[0]",
                   (Row("requests[r4].gpu_pages[0]", ()),)),
        PathSample("run-b", "L2-4096", 2, "requests[r8].gpu_pages[1]",
                   (Row("requests[r8].gpu_pages[1]", ()),)),
    )  # fmt: skip
    assert (free.path, free.count) == ("free_pages[*]", 1)
    assert (exception.op, exception.path, exception.kinds) == (
        "evict",
        "<exception>",
        ("exception",),
    )


def test_keeps_a_bounded_sample_per_field_path_in_log_order():
    records = [divergence(step, [f"requests[r{step}].phase"]) for step in range(10)]
    [stats] = aggregate(records).paths
    assert stats.count == 10
    assert [sample.step for sample in stats.samples] == list(range(MAX_SAMPLES))


def test_counts_compared_and_diverged_steps_per_workload_and_op():
    pairs = aggregate(RECORDS + [divergence(1, ["x"], op="poll", workload="smoke")]).pairs
    assert [PairStats(*astuple(pair)[:5]) for pair in pairs] == [
        PairStats(
            "L2-2048", "alloc", 100, 2, (("requests[*].gpu_pages[*]", 2), ("free_pages[*]", 1))
        ),
        PairStats("L2-2048", "evict", 20, 0, ()),
        PairStats("L2-4096", "alloc", 200, 1, (("requests[*].gpu_pages[*]", 1),)),
        PairStats("L2-4096", "evict", 50, 1, (("<exception>", 1),)),
        PairStats("L2-4096", "migrate", 10, 0, ()),
        PairStats("smoke", "poll", 0, 1, (("x", 1),)),
    ]
    # the first divergence of the pair at each of its top paths
    assert [sample.path for sample in pairs[0].samples] == [
        "requests[r17].gpu_pages[3]",
        "free_pages[2]",
    ]


def test_renders_text_tables_with_the_headline_ops_and_field_paths():
    text = render_text(aggregate(RECORDS))
    assert text.startswith("4 divergences in 380 compared ops, 2 harness errors\n")
    assert (
        "2 runs, 2 harness errors; compare harness 2 s on 8 s of authoritative ops (0.25x the"
        " ops compared, not of the job)"
    ) in text
    assert "requests[*].gpu_pages[*]" in text
    wide = render_text(aggregate(RECORDS), width=200)
    assert "requests[r17].gpu_pages[3..4] (L2-2048 step 5)" in wide
    assert [
        line for line in text.splitlines() if line.startswith("│ ") and line.endswith("% │")
    ] == [
        "│ alloc   │      300 │           3 │ 1.00% │",
        "│ evict   │       70 │           1 │ 1.43% │",
        "│ migrate │       10 │           0 │ 0.00% │",
    ]


def test_renders_markdown_with_the_headline_and_a_table_per_op_and_per_field_path():
    markdown = render_markdown(aggregate(RECORDS))
    lines = markdown.splitlines()
    assert lines[0] == "### 4 divergences in 380 compared ops, 2 harness errors"
    assert "| alloc | 300 | 3 | 1.00% |" in lines
    assert (
        "| alloc | `requests[*].gpu_pages[*]` | 3 | 2-9 | L2-2048, L2-4096 | state | "
        "`requests[r17].gpu_pages[3..4]` (L2-2048 step 5) |" in lines
    )


def test_markdown_keeps_backticks_and_line_breaks_of_ids_inside_their_cells():
    records = [divergence(7, ["requests[a`b].phase", "requests[`c].phase"], workload="w\r\nz")]
    lines = render_markdown(aggregate(records)).splitlines()
    assert (
        lines[-1]
        == "| alloc | `requests[*].phase` | 1 | 7 | w  z | state | ``requests[a`b].phase``<br>"
        "``requests[`c].phase`` (w  z step 7) |"
    )
    assert (
        render_markdown(aggregate([divergence(7, ["`c"])])).splitlines()[-1]
        == "| alloc | `` `c `` | 1 | 7 | L2-2048 | state | `` `c `` (L2-2048 step 7) |"
    )


def test_limits_the_markdown_field_path_table_and_says_how_many_were_left_out():
    records = [divergence(0, [f"field_{n}"]) for n in range(5)]
    markdown = render_markdown(aggregate(records), max_paths=2)
    assert markdown.count("| alloc | `field_") == 2
    assert "... and 3 more field paths." in markdown


def test_renders_a_clean_report_without_a_field_path_table():
    report = aggregate([summary("smoke", "run-c", {"alloc": 1})])
    assert render_markdown(report).splitlines()[0] == "### 0 divergences in 1 compared op"
    assert "field path" not in render_markdown(report)
    assert "By field path" not in render_text(report)


def test_renders_junit_with_a_failing_testcase_per_diverging_workload_and_op():
    suites = ET.fromstring(render_junit(aggregate(RECORDS)))
    [suite] = suites.findall("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("6", "4")
    cases = {case.get("name"): case.find("failure") for case in suite.findall("testcase")}
    assert list(cases) == [
        "L2-2048.alloc",
        "L2-2048.evict",
        "L2-4096.alloc",
        "L2-4096.evict",
        "L2-4096.migrate",
        "harness",
    ]
    assert cases["harness"].get("message") == "2 harness errors: the ops they hit were not compared"
    assert cases["L2-2048.evict"] is None
    failure = cases["L2-2048.alloc"]
    assert failure.get("message") == "2 divergences in 100 compared steps"
    assert failure.text.splitlines() == [
        "2 x requests[*].gpu_pages[*]",
        "    requests[r17].gpu_pages[3..4]",
        "    (L2-2048 step 5)",
        "1 x free_pages[*]",
        "    free_pages[2]",
        "    (L2-2048 step 9)",
    ]
    assert suite.find("properties/property[@name='harness_errors']").get("value") == "2"


def test_junit_and_headline_name_no_harness_case_when_the_harness_never_failed():
    report = aggregate([summary("smoke", "run-c", {"alloc": 1})])
    [suite] = ET.fromstring(render_junit(report)).findall("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("1", "0")
    assert headline(report) == "0 divergences in 1 compared op"
    assert headline(aggregate(RECORDS)).endswith(", 2 harness errors")


def test_junit_escapes_characters_xml_cannot_hold_so_the_document_stays_readable():
    records = [
        divergence(1, ["requests[r1].phase\x1b"], workload="w\x00<&>\x7f\ufffe"),
        summary("w\x00<&>\x7f\ufffe", "run-a", {"alloc": 4}),
    ]
    [case] = ET.fromstring(render_junit(aggregate(records))).iter("testcase")
    assert case.get("name") == "w\\x00<&>\x7f\\ufffe.alloc"
    assert case.find("failure").text.splitlines() == [
        "1 x requests[*].phase\\x1b",
        "    requests[r1].phase\\x1b",
        "    (w\\x00<&>\x7f\\ufffe step 1)",
    ]


def test_text_writes_control_characters_of_ids_as_escapes_not_to_the_terminal():
    records = [
        divergence(1, ["requests[r1].phase\x1b[2J"], workload="w\x1b]0;title\x07\x9b"),
        summary("w\x1b]0;title\x07\x9b", "run-a", {"alloc": 4}),
    ]
    text = render_text(aggregate(records), width=400)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", text)
    assert "requests[*].phase\\x1b[2J" in text
    assert "requests[r1].phase\\x1b[2J (w\\x1b]0;title\\x07\\x9b step 1)" in text


def test_renders_json_with_every_count():
    data = json.loads(render_json(aggregate(RECORDS)))
    assert (data["num_compared"], data["num_divergences"]) == (380, 4)
    assert data["paths"][0]["path"] == "requests[*].gpu_pages[*]"
    assert data["paths"][0]["samples"][0] == {
        "run_id": "run-a",
        "workload": "L2-2048",
        "step": 5,
        "path": "requests[r17].gpu_pages[3]",
        "rows": [{"path": "requests[r17].gpu_pages[3..4]", "values": []}],
        "more_rows": 0,
    }
    assert data["pairs"][0]["top_paths"] == [["requests[*].gpu_pages[*]", 2], ["free_pages[*]", 1]]
