"""A dozen mutants of validate's mutation sample (``scripts/validate_mutation_score.py``, seed 0),
spread over the KV files and the worker, each killed by the one corpus workload named beside it.

Each mutant is injected into its function (``injected_bugs.mutate``: the function recompiled with
one edit, undone after the test) and the workload runs as ``batchgen validate --fail-fast`` runs a
corpus file: a fresh compare-mode worker, legacy serving with the plan shadowed, the page-content
oracle on, every check of a corpus run. The run must fail. When one of them stops failing,
validation got weaker there: the mutation score would show it an hour later; this shows it in
seconds.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest
from injected_bugs import mutate

from batchgen.engine import worker
from batchgen.kv import appliers, copy_runs, legacy, manager, plan_path  # noqa: F401 (loaded first)
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import DIRECTIONS
from batchgen.validation.session import FailFast, Session
from batchgen.validation.validate import CORPUS_DIR, corpus_workloads

Manager, Legacy, Worker = manager.KVCacheManager, legacy.LegacyKvPath, worker.Worker


@dataclass(frozen=True)
class SampledMutant:
    """``old`` -> ``new`` in ``owner.function`` (line: where the sample found it), and the corpus
    workload that kills it."""

    path: str
    line: int
    owner: object  # the class or module holding the function
    function: str
    old: str
    new: str
    workload: str

    def inject(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Mutates ``owner`` and every loaded module that imported the function by name (the plan
        path imports the appliers so) until ``monkeypatch`` is undone."""
        original = getattr(self.owner, self.function)
        mutant = mutate(original, self.old, self.new)
        monkeypatch.setattr(self.owner, self.function, mutant)
        for module in list(sys.modules.values()):
            if getattr(module, self.function, None) is original:
                monkeypatch.setattr(module, self.function, mutant)


MUTANTS = (
    SampledMutant("kv/manager.py", 105, Manager, "plan_eviction",
                  "page_size) - num_pages", "page_size) ** num_pages", "corpus-00"),
    SampledMutant("kv/manager.py", 112, Manager, "plan_eviction",
                  "snapshot.num_free_host_pages - free_host",
                  "snapshot.num_free_host_pages % free_host", "corpus-00"),
    SampledMutant("kv/manager.py", 156, Manager, "plan_migration",
                  "if free.num_free - demand - num_new", "if free.num_free + demand - num_new",
                  "corpus-00"),
    SampledMutant("kv/manager.py", 184, Manager, "plan_allocation",
                  "tuple(free.take_new(need))", "tuple(free.take_new(need // 2))", "corpus-00"),
    SampledMutant("kv/manager.py", 178, manager, "_poll_decision",
                  "if num_retries < geometry.max_load_retries:",
                  "if num_retries >= geometry.max_load_retries:", "corpus-00"),
    SampledMutant("kv/manager.py", 195, manager, "_victims",
                  "host_ids[start : start + len(gpu_page_ids)]",
                  "host_ids[start : start & len(gpu_page_ids)]", "corpus-00"),
    SampledMutant("kv/legacy.py", 39, Legacy, "_decode_demand",
                  "page_size) - len", "page_size) | len", "corpus-00"),
    SampledMutant("kv/legacy.py", 59, Legacy, "poll",
                  "if req.num_load_retries < self.engine_config.max_load_retries:",
                  "if req.num_load_retries == self.engine_config.max_load_retries:", "corpus-00"),
    SampledMutant("kv/appliers.py", 81, appliers, "apply_eviction_plan",
                  "if not plan.victims:", "if plan.victims:", "corpus-00"),
    SampledMutant("kv/appliers.py", 129, appliers, "apply_alloc_plan",
                  "for grant in plan.grants:", "for grant in []:", "corpus-00"),
    SampledMutant("kv/copy_runs.py", 125, copy_runs, "_copy_on_host",
                  "dst_pages[dst_start : dst_start + length]",
                  "dst_pages[dst_start : dst_start ** length]", "corpus-00"),
    SampledMutant("kv/copy_runs.py", 150, copy_runs, "pair_runs",
                  "(src_ids[1:] != src_ids[:-1] + 1)", "(src_ids[1:] is src_ids[:-1] + 1)",
                  "corpus-00"),
)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture(scope="module")
def corpus() -> dict:
    return {workload.name: workload for workload in corpus_workloads(CORPUS_DIR)}


def run_as_validate_does(model, workload, tmp_path) -> list[str]:
    """``workload`` as validate --fail-fast runs a corpus file, legacy serving and the plan
    shadowed; the failures (empty when every check passed)."""
    session = Session(model, "cpu", tmp_path / "log.jsonl", {}, None, fail_fast=True)
    try:
        session.run_corpus(DIRECTIONS[0], [workload])
    except FailFast:
        pass
    return session.failures


def test_each_killing_workload_passes_unmutated(model, corpus, tmp_path):
    for name in sorted({mutant.workload for mutant in MUTANTS}):
        assert run_as_validate_does(model, corpus[name], tmp_path / name) == []


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: f"{m.path}:{m.line}")
def test_the_corpus_workload_kills_its_sampled_mutant(mutant, model, corpus, monkeypatch, tmp_path):
    mutant.inject(monkeypatch)
    failures = run_as_validate_does(model, corpus[mutant.workload], tmp_path)
    assert failures and failures[0].startswith(f"{mutant.workload} legacy/plan: "), failures
