"""``batchgen explore``: a seeded, coverage-guided search that keeps what reaches something new,
cuts it to a small corpus, and keeps a diverging candidate for replay and minimize."""

from __future__ import annotations

import json

import pytest
from injected_bugs import reversed_grants

from batchgen.cli import explore as explore_command
from batchgen.cli import main
from batchgen.engine.workloads import load_workload
from batchgen.sweep.backends import ProcessBackend, TaskDone, TaskFailed
from batchgen.triage.minimize import minimize_divergence
from batchgen.triage.replay import replay_record
from batchgen.validation.explore import BATCH, ExploreError, explore, smallest_cover, write_corpus
from compare import DivergenceRecord, read_log


def test_the_search_is_the_same_for_the_same_seed_and_budget():
    first, second = (explore(seed=3, max_runs=6) for _ in range(2))
    assert first.num_runs == second.num_runs == 6
    assert [k.workload for k in first.kept] == [k.workload for k in second.kept]
    assert first.reached == second.reached


def test_each_kept_candidate_reached_something_no_earlier_one_did():
    result = explore(seed=5, max_runs=8)
    seen: set[str] = set()
    for kept in result.kept:
        new = set(kept.run.coverage) - seen
        assert new and set(kept.new_outcomes) == new
        seen |= new
    assert seen == result.reached.keys()
    assert {result.reached[o] for o in seen} == {k.workload.name for k in result.kept}


def test_the_search_stops_after_the_batch_that_reaches_every_required_outcome():
    result = explore(seed=0, max_runs=50, required={"alloc.admit", "release.finished"})
    assert result.num_runs == BATCH and result.missed == ()


def test_the_search_is_the_same_on_a_process_pool():
    with ProcessBackend(2) as backend:
        pooled = explore(seed=3, max_runs=10, backend=backend)
    serial = explore(seed=3, max_runs=10)
    assert pooled.num_runs == serial.num_runs == 10
    assert [k.workload for k in pooled.kept] == [k.workload for k in serial.kept]
    assert pooled.reached == serial.reached


def test_the_search_reaches_a_named_interaction_and_keeps_the_workload_that_did():
    result = explore(seed=0, max_runs=16, required={"evict.seq.host_then_recompute"})
    assert (result.num_runs, result.missed) == (BATCH, ())
    first = result.reached["evict.seq.host_then_recompute"]
    kept = next(k for k in result.kept if k.workload.name == first)
    assert "evict.seq.host_then_recompute" in kept.new_outcomes
    assert kept.run.coverage["evict.seq.host_then_recompute"] >= 1


def test_a_missed_outcome_is_named_with_the_budget_spent():
    result = explore(seed=0, max_runs=2, required={"alloc.does_not_fit"})
    assert (result.num_runs, result.missed) == (2, ("alloc.does_not_fit",))


def test_the_corpus_is_the_fewest_kept_workloads_reaching_everything_and_loads_back(tmp_path):
    result = explore(seed=1, max_runs=10)
    cover = smallest_cover(result.kept)
    assert set().union(*(k.run.coverage for k in cover)) == result.reached.keys()
    assert len(cover) <= len(result.kept)
    (tmp_path / "corpus-99.json").write_text("left from an earlier search")
    paths = write_corpus(cover, tmp_path)
    assert sorted(tmp_path.glob("corpus-*.json")) == paths
    loaded = [load_workload(str(path)) for path in paths]
    assert [w.name for w in loaded] == [f"corpus-{i:02d}" for i in range(len(cover))]
    assert [w.requests for w in loaded] == [k.workload.requests for k in cover]


class FailingBackend:
    """Runs each task in this process, except candidate ``failing``, whose every attempt fails."""

    num_workers = 1

    def __init__(self, failing: int):
        self.failing = failing

    def map_runs(self, function, arguments, on_done, *, max_retries=0):
        for index, argument in enumerate(arguments):
            if index == self.failing:
                on_done(index, TaskFailed("worker died", max_retries + 1))
            else:
                on_done(index, TaskDone(function(argument), 1))

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        pass


def test_a_candidate_whose_task_fails_every_attempt_stops_the_search_naming_it():
    with pytest.raises(ExploreError) as error:
        explore(seed=0, max_runs=4, backend=FailingBackend(2))
    assert str(error.value) == (
        "candidate explore-0-2 failed in 3 attempts on the backend, the last with: worker died"
    )


def test_the_command_exits_1_on_a_failed_candidate_and_writes_no_corpus(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(explore_command, "backend_from_args", lambda args: FailingBackend(0))
    corpus = tmp_path / "corpus"
    assert main(["explore", "--max-runs", "4", "--corpus-dir", str(corpus)]) == 1
    assert capsys.readouterr().err.endswith(
        "batchgen: explore stopped: candidate explore-0-0 failed in 3 attempts on the backend,"
        " the last with: worker died\n"
    )
    assert not list(corpus.glob("corpus-*.json"))


def test_a_diverging_candidate_is_kept_apart_and_replays_and_minimizes(tmp_path, monkeypatch):
    reversed_grants(monkeypatch)
    result = explore(seed=0, max_runs=2, log_dir=tmp_path)
    assert result.divergences
    path, text = result.divergences[0]
    assert path.stem not in {kept.workload.name for kept in result.kept}
    assert text.startswith("alloc step ") and path.exists()
    records = read_log(path.with_suffix(".jsonl")).records
    record = next(r for r in records if isinstance(r, DivergenceRecord))
    assert record.replay["workload_source"] == str(path.resolve())
    assert replay_record(record).reproduced
    minimal = minimize_divergence(record, max_tests=40)
    assert len(minimal.workload.requests) <= len(load_workload(str(path)).requests)


def test_the_command_writes_the_corpus_and_exits_1_naming_what_it_missed(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    assert main(["explore", "--max-runs", "2", "--corpus-dir", str(corpus), "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["runs"] == 2 and summary["missed"] and summary["divergences"] == []
    assert summary["corpus"] == [str(p) for p in sorted(corpus.glob("corpus-*.json"))]
    assert {spent["runs"] for spent in summary["missed"].values()} == {2}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--time-budget", "0"], "argument --time-budget: must be a number of seconds > 0"),
        (["--max-runs", "0"], "argument --max-runs"),
        (["--ray-address", "auto"], "--ray-address applies to --backend ray"),
        (["--backend", "gpu"], "argument --backend: invalid choice: 'gpu'"),
    ],
)
def test_bad_flags_are_refused_before_anything_runs(argv, message, tmp_path, capsys):
    assert main(["explore", "--corpus-dir", str(tmp_path / "c"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
