"""docs/compare.md's worked example runs as written."""

from pathlib import Path

from compare import RunSummary, read_log

DOC = Path(__file__).parents[2] / "docs" / "compare.md"


def test_the_toy_scheduler_example_in_the_docs_runs(tmp_path, monkeypatch, capsys):
    code = DOC.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)  # the example's log goes to the working directory
    namespace = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    assert capsys.readouterr().out == "{'admit': 3} {}\n"
    assert namespace["state"] == {"queue": [("n2", 20)], "running": ["r1", "r2", "r3", "n0", "n1"]}
    (summary,) = read_log(tmp_path / "sched-divergences.jsonl").records
    assert isinstance(summary, RunSummary)
    assert (summary.binding, summary.workload, summary.authoritative, summary.shadow) == (
        "toy-scheduler",
        "burst",
        "planner",
        "legacy",
    )
    assert {outcome: count.count for outcome, count in summary.coverage.items()} == {
        "admit.some": 3
    }
