"""The HTML page: well-formed, a chart per run that recorded a timeline, divergences marked with
their replay commands, the numbers of the JSON report, and every logged string escaped."""

import json
import xml.etree.ElementTree as ET

import pytest

from compare.charts import Panel
from compare.coverage import Outcome
from compare.html import PageBinding, render_html
from compare.records import DivergenceRecord, OutcomeCount, RunSummary, Timeline
from compare.render import headline, render_json
from compare.report import aggregate

SVG = "{http://www.w3.org/2000/svg}"
SCRIPT_ID = "<script>alert('x')</script>"
BINDING = PageBinding(
    title="test page",
    panels=(Panel("held", ("held",), ("capacity",)), Panel("events", ("events",))),
    labels={"held": "pages held", "capacity": "pool"},
    replay="tool replay {log} --index {index}",
)
CATALOG = (
    Outcome("alloc.fits", "alloc", "the pages fit"),
    Outcome("alloc.exact_fit", "alloc", "the pages fit exactly"),
    Outcome("alloc.never", "alloc", "cannot happen", unreachable="ruled out by a test"),
)


def divergence(run_id, workload, step, paths, *, op="alloc", shadow="plan"):
    return DivergenceRecord(
        binding="kv",
        run_id=run_id, workload=workload, seed=0, step=step, op=op, authoritative="legacy",
        shadow=shadow, kind="state", field_paths=paths, diff={}, exception=None, replay={},
        created_at=0.0,
    )  # fmt: skip


def summary(run_id, workload, *, first_step=0, timeline=True, shadow="plan", diverged=0):
    counters = {"held": [1, 3, 4, 4, 2, 0], "events": [0, 1, 0, 2, 0, 0]}
    return RunSummary(
        binding="kv",
        run_id=run_id, workload=workload, seed=3, authoritative="legacy", shadow=shadow,
        steps_compared={"alloc": 6, "evict": 6}, divergences={"alloc": diverged},
        harness_errors=0, compare_seconds=0.5, authoritative_seconds=2.0,
        coverage={"alloc.fits": OutcomeCount(count=4, first_step=first_step + 1)},
        timeline=Timeline(first_step=first_step, counters=counters, levels={"capacity": 5})
        if timeline else None,
    )  # fmt: skip


# log A: a run with three divergences at two steps, then an A/A run whose id and field path hold
# markup; log B: a run without a timeline, and one that never ended
LOG_A = [
    divergence("run-a", "L2 a", 1, ["requests[r1].pages[0]", "free[2]"]),
    divergence("run-a", "L2 a", 1, ["requests[r2].pages[1]"], op="evict"),
    divergence("run-a", "L2 a", 4, ["requests[r1].pages[3]"]),
    summary("run-a", "L2 a", diverged=3),
    divergence(SCRIPT_ID, SCRIPT_ID, 8, [f"requests[{SCRIPT_ID}].pages[0]"], shadow="legacy"),
    summary(SCRIPT_ID, SCRIPT_ID, first_step=6, shadow="legacy", diverged=1),
]
LOG_B = [
    summary("run-c", "no timeline", timeline=False),
    divergence("run-d", "cut short", 2, ["requests[r9].pages[0]"]),
]
LOGS = [("logs/a b.jsonl", LOG_A), ("b.jsonl", LOG_B)]


@pytest.fixture(scope="module")
def report():
    return aggregate([*LOG_A, *LOG_B], CATALOG)


@pytest.fixture(scope="module")
def page(report):
    return ET.fromstring(render_html(report, LOGS, BINDING))


def by_id(page, element_id):
    [element] = [e for e in page.iter() if e.get("id") == element_id]
    return element


def text(element) -> str:
    return "".join(element.itertext())


def rows(table) -> list[list[str]]:
    return [[text(cell) for cell in row.findall("td")] for row in table.findall("tr")[1:]]


def runs(page):
    return [section for section in page.iter("section") if section.get("class") == "run"]


def test_the_page_is_well_formed_with_a_chart_for_each_run_that_recorded_a_timeline(page):
    sections = runs(page)
    assert [text(section.find("h3")) for section in sections] == [
        "L2 a", SCRIPT_ID, "no timeline", "cut short",
    ]  # fmt: skip
    assert [len(section.findall(f".//{SVG}svg")) for section in sections] == [1, 1, 0, 0]
    assert "No timeline recorded." in text(sections[2])
    assert "No run summary: the run did not end." in text(sections[3])
    ids = [element.get("id") for element in page.iter() if element.get("id")]
    assert len(ids) == len(set(ids))


def test_its_numbers_are_the_json_reports(page, report):
    data = json.loads(render_json(report))
    assert text(by_id(page, "headline")) == headline(report)
    assert (data["num_divergences"], data["num_compared"]) == (5, 36)
    assert rows(by_id(page, "ops")) == [
        [op["op"], str(op["num_compared"]), str(op["num_divergences"]),
         f"{op['num_divergences'] / op['num_compared']:.2%}"]
        for op in data["ops"]
    ]  # fmt: skip
    coverage = [row[:4] for row in rows(by_id(page, "coverage"))]
    assert coverage == [
        [row["outcome"], row["op"], str(row["count"]), str(row["num_runs"])]
        for row in data["coverage"]
    ]
    paths = [row[:3] for row in rows(by_id(page, "paths"))]
    assert paths == [[p["op"], p["path"], str(p["count"])] for p in data["paths"]]


def test_each_diverging_step_is_marked_with_its_ops_paths_and_replay_commands(page):
    chart = runs(page)[0].find(f".//{SVG}svg")
    titles = [text(title) for title in chart.iter(f"{SVG}title")]
    assert titles == [
        "step 1: 2 divergences\n"
        "alloc state:\n    requests[r1].pages[0]\n    free[2]\n"
        "  tool replay 'logs/a b.jsonl' --index 0\n"
        "evict state:\n    requests[r2].pages[1]\n"
        "  tool replay 'logs/a b.jsonl' --index 1",
        "step 4: 1 divergence\nalloc state:\n    requests[r1].pages[3]\n"
        "  tool replay 'logs/a b.jsonl' --index 2",
    ]
    links = [
        (a.get("{http://www.w3.org/1999/xlink}href"), a.get("target"))
        for a in chart.iter(f"{SVG}a")
    ]
    assert links == [("#d-0-0", None), ("#d-0-2", None)]
    listed = rows(runs(page)[0].find("table"))
    assert [(row[0], row[4]) for row in listed] == [
        ("1", "tool replay 'logs/a b.jsonl' --index 0"),
        ("1", "tool replay 'logs/a b.jsonl' --index 1"),
        ("4", "tool replay 'logs/a b.jsonl' --index 2"),
    ]
    assert by_id(page, "d-0-2").tag == "tr"


def test_replay_indexes_count_each_logs_divergences_from_zero(page):
    [row] = rows(runs(page)[3].find("table"))
    assert row[4] == "tool replay b.jsonl --index 0"


def test_a_logged_script_is_text_and_no_element_or_handler(report):
    source = render_html(report, LOGS, BINDING)
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in source
    page = ET.fromstring(source)
    assert text(runs(page)[1].find("h3")) == SCRIPT_ID
    assert f"requests[{SCRIPT_ID}].pages[0]" in text(runs(page)[1].find("table"))
    tags = {element.tag.rpartition("}")[2] for element in page.iter()}
    assert not tags & {"script", "iframe", "img", "object", "embed", "link", "foreignObject"}
    attributes = [name for element in page.iter() for name in element.attrib]
    assert not [name for name in attributes if name.lower().startswith("on")]


def test_the_page_fetches_nothing(report):
    page = ET.fromstring(render_html(report, LOGS, BINDING))
    targets = [
        value
        for element in page.iter()
        for name, value in element.attrib.items()
        if name.rpartition("}")[2] in ("href", "src")
    ]
    assert targets and all(target.startswith("#") for target in targets)
    assert "url(http" not in text(page.find("head/style"))


def test_control_characters_from_a_log_leave_the_page_well_formed():
    records = [summary("run-\x1b[31m", "w\x00ork")]
    page = ET.fromstring(render_html(aggregate(records), [("x.jsonl", records)], BINDING))
    assert text(runs(page)[0].find("h3")) == "w\\x00ork"


def test_required_outcomes_no_run_reached_are_highlighted(page, report):
    table = by_id(page, "coverage")
    highlighted = [
        cells[0]
        for row, cells in zip(table.findall("tr")[1:], rows(table))
        if row.get("class") == "unreached"
    ]
    assert highlighted == list(report.unreached) == ["alloc.exact_fit"]


def test_the_aa_line_counts_the_runs_whose_shadow_is_the_authoritative_path(page):
    assert text(by_id(page, "aa")) == (
        "A/A noise check: 1 divergence in 12 compared ops over 1 A/A run"
        " (NOISE: the harness differs from itself)"
    )
    assert "(A/A noise check)" in text(runs(page)[1])


def test_a_page_of_many_runs_charts_the_diverging_ones_and_fills_up_with_clean_ones(monkeypatch):
    monkeypatch.setattr("compare.html.MAX_CHARTED", 3)
    clean = [summary(f"clean-{i}", f"clean {i}", timeline=False) for i in range(4)]
    log = [*clean[:2], divergence("bad", "bad", 1, ["free[0]"]), summary("bad", "bad"), *clean[2:]]
    page = ET.fromstring(render_html(aggregate(log, CATALOG), [("x.jsonl", log)], BINDING))
    assert [text(section.find("h3")) for section in runs(page)] == ["clean 0", "clean 1", "bad"]
    assert text(by_id(page, "uncharted")) == (
        "2 more runs without a divergence not charted (at most 3 charts a page); the tables count"
        " every run"
    )
