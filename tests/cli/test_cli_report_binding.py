"""``batchgen report`` on a log another slice's ``compare.Experiment`` wrote: rendered with its
binding (compare's plain page, no KV catalog, no replay command); replay and minimize refuse it."""

import xml.etree.ElementTree as ET

import pytest

from batchgen.cli import main
from compare import Experiment, Timeline


@pytest.fixture
def toy_log(tmp_path):
    """Two runs of a toy scheduler: the first diverges at step 1 and records no timeline; the
    second agrees and records a timeline of one counter."""
    log = tmp_path / "toy.jsonl"
    with Experiment(
        "toy-scheduler",
        paths=("planner", "legacy"),
        log=log,
        run_id="toy-1",
        outcomes=lambda op, context, authoritative, shadow: ["admit.some"],
    ) as experiment:
        for step, shadow in enumerate((["r0"], ["r2"])):
            experiment.run(
                "admit", step, authoritative=lambda: ["r0"], shadow=lambda f, s=shadow: s
            )
    with Experiment("toy-scheduler", paths=("planner", "legacy"), log=log, run_id="toy-2") as run:
        run.run("admit", 0, authoritative=lambda: 1, shadow=lambda fork: 1)
        run.close(timeline=Timeline(first_step=0, counters={"queued": [3, 1]}))
    return log


def test_the_text_report_lists_the_runs_own_outcomes_and_no_kv_catalog(toy_log, capsys):
    assert main(["report", str(toy_log)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("1 divergence in 3 compared ops\ndecision coverage: 1 outcome reached\n")
    assert "alloc.exact_fit" not in out and "admit.some" in out


def test_the_html_page_charts_the_runs_counters_without_kv_panels_or_replay(toy_log, capsys):
    assert main(["report", str(toy_log), "--format", "html"]) == 1
    page = capsys.readouterr().out
    root = ET.fromstring(page.split("\n", 1)[1])
    assert root.find(".//h1").text == "toy-scheduler compare report"
    assert "GPU pages held" not in page and "batchgen replay" not in page
    headers = [th.text for th in root.iter("th")]
    assert "replay" not in headers
    assert page.count('<figure class="chart">') == 1  # toy-2's timeline: one panel, "queued"
    assert ">queued<" in page


def test_replay_and_minimize_refuse_a_record_of_another_binding(toy_log, capsys):
    for command in ("replay", "minimize"):
        assert main([command, str(toy_log), "--index", "0"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"batchgen: error: {toy_log}: record 0 is of the 'toy-scheduler' binding; batchgen"
            " re-runs records of the 'kv' binding only"
        )


def test_logs_of_two_bindings_are_reported_apart(toy_log, logs, capsys):
    clean, _ = logs
    assert main(["report", str(clean), str(toy_log)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"batchgen: error: the logs hold runs of several bindings (kv: {clean}; toy-scheduler:"
        f" {toy_log}); report each apart"
    )
