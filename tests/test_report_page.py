"""``batchgen report --format html``: the page of a small diverging run, whose request ids hold
markup. Its numbers are the JSON report's, it has a chart with each diverging step marked, the
ids show as text; and in headless Chromium it loads without a console error and is not blank.

The browser test is skipped only where no Chromium is installed, and never in CI: ``.ci/run``
installs Debian's ``chromium`` and sets ``BATCHGEN_REQUIRE_BROWSER=1``.
"""

import io
import json
import os
import xml.etree.ElementTree as ET

import pytest
from headless_chromium import find_chromium, view_page
from injected_bugs import reversed_grants
from PIL import Image

from batchgen.cli import main
from batchgen.engine.workloads import load_workload
from batchgen.model.loader import load_model
from compare import DivergenceRecord, read_log

SVG = "{http://www.w3.org/2000/svg}"
MARKUP = "<script>alert({})</script>"


@pytest.fixture(scope="module")
def diverging_log(tmp_path_factory):
    """A compare run of smoke, its request ids ``<script>alert(i)</script>``, whose plan path
    hands out each grant's pages reversed: alloc divergences."""
    directory = tmp_path_factory.mktemp("diverging")
    smoke = load_workload("smoke", vocab_size=load_model("tiny").config.vocab_size)
    requests = [
        r.model_copy(update={"uuid": MARKUP.format(i)}) for i, r in enumerate(smoke.requests)
    ]
    workload = directory / "marked.json"
    workload.write_text(smoke.model_copy(update={"requests": requests}).to_json())
    log = directory / "kv.jsonl"
    with pytest.MonkeyPatch.context() as monkeypatch:
        reversed_grants(monkeypatch)
        flags = ["--kv-compare", "log", "--kv-compare-log", str(log), "--json"]
        assert main(["run", "--workload", str(workload), *flags]) == 0
    return log


@pytest.fixture(scope="module")
def pages(diverging_log):
    """The log's HTML page and JSON report."""
    directory = diverging_log.parent
    for kind in ("html", "json"):
        out = directory / f"report.{kind}"
        assert main(["report", str(diverging_log), "--format", kind, "--out", str(out)]) == 1
    return directory / "report.html", json.loads((directory / "report.json").read_text())


def text(element) -> str:
    return "".join(element.itertext())


def table(page, table_id) -> list[list[str]]:
    [found] = [e for e in page.iter("table") if e.get("id") == table_id]
    return [[text(cell) for cell in row.findall("td")] for row in found.findall("tr")[1:]]


def test_the_pages_numbers_are_the_json_reports(pages):
    path, data = pages
    page = ET.parse(path).getroot()
    assert data["num_divergences"] > 0
    assert [row[:3] for row in table(page, "ops")] == [
        [op["op"], str(op["num_compared"]), str(op["num_divergences"])] for op in data["ops"]
    ]
    assert [row[:4] for row in table(page, "coverage")] == [
        [row["outcome"], row["op"], str(row["count"]), str(row["num_runs"])]
        for row in data["coverage"]
    ]
    assert [row[:3] for row in table(page, "paths")] == [
        [stats["op"], stats["path"], str(stats["count"])] for stats in data["paths"]
    ]


def test_the_run_has_one_chart_marking_each_step_that_diverged(pages, diverging_log):
    page = ET.parse(pages[0]).getroot()
    [run] = [section for section in page.iter("section") if section.get("class") == "run"]
    [chart] = run.iter(f"{SVG}svg")
    records = [r for r in read_log(diverging_log).records if isinstance(r, DivergenceRecord)]
    titles = [text(title) for title in chart.iter(f"{SVG}title")]
    assert [title.partition(":")[0] for title in titles] == [
        f"step {step}" for step in sorted({record.step for record in records})
    ]
    assert f"batchgen replay {diverging_log} --index 0" in titles[0]


def test_request_ids_holding_markup_show_as_text_and_add_no_element(pages):
    source = pages[0].read_text()
    assert "&lt;script&gt;alert(" in source and "<script" not in source
    page = ET.fromstring(source)
    assert MARKUP.format(0) in text(page)
    assert not [element for element in page.iter() if element.tag.endswith("script")]


def test_report_writes_the_page_to_stdout_without_out(diverging_log, capsys):
    assert main(["report", str(diverging_log), "--format", "html"]) == 1
    assert ET.fromstring(capsys.readouterr().out).tag == "html"


def test_chromium_shows_the_page_without_console_errors_and_not_blank(pages):
    chromium = find_chromium()
    if chromium is None:
        if os.environ.get("BATCHGEN_REQUIRE_BROWSER"):
            pytest.fail("BATCHGEN_REQUIRE_BROWSER is set but no chromium is installed")
        pytest.skip("no chromium installed (apt-get install -y chromium)")
    view = view_page(chromium, pages[0], width=1280, height=2000)
    assert view.errors == []
    assert view.scroll_width <= 1280  # no horizontal scroll at 1280 px
    image = Image.open(io.BytesIO(view.screenshot)).convert("RGB")
    assert image.size == (1280, 2000)
    colours = image.getcolors(maxcolors=1 << 16)
    # a blank page is one colour; text, tables and chart lines bring hundreds
    assert colours is None or len(colours) > 64
