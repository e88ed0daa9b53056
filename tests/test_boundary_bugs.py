"""A comparison flipped at any ``==`` boundary of the KV policy, on either path, is caught by what
``batchgen validate`` runs: L2-2048 and L2-4096 back to back, then the corpus.

The compare runs here are validate's (compare mode raise, plan authoritative, legacy shadowed),
on the weightless model: a boundary bug changes which pages move, and compare mode sees that
whatever the tokens are. ``scripts/boundary_bugs.py`` runs the whole validation per bug.
"""

from __future__ import annotations

import pytest
from injected_bugs import BOUNDARY_BUGS

from batchgen.config import TINY_MODELS
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import run_workload
from batchgen.engine.workloads import Workload, builtin_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.plan_checks import PlanRejected
from batchgen.model.null_model import NullModel
from batchgen.shadow.wiring import gated_worker
from batchgen.validation.validate import BACK_TO_BACK_WORKLOADS, CORPUS_DIR, corpus_workloads
from compare import DivergenceError


def diverges(workloads: list[Workload], tmp_path, *, shared: bool) -> bool:
    """Whether compare mode raise stops on a divergence while running ``workloads``, on one
    worker (of the last workload's pools) or a fresh worker each."""
    gate = KvGateConfig(path="plan", compare="raise", compare_log=str(tmp_path / "log.jsonl"))
    worker = None
    for workload in workloads:
        if worker is None or not shared:
            pools = workloads[-1] if shared else workload
            faults = FaultInjector(FaultSpec.parse(workload.faults)) if workload.faults else None
            worker = gated_worker(
                NullModel(TINY_MODELS["tiny"]), cache_config=pools.cache,
                engine_config=pools.engine, kv_gate=gate, faults=faults, kv_storage=False,
            )  # fmt: skip
        try:
            run_workload(worker, workload)
        except (DivergenceError, PlanRejected):  # the plan path's applier rejected its own plan
            return True
    return False


@pytest.fixture(scope="module")
def caught_by_l2_alone():
    """Which boundary bugs the L2 traces alone (validation before the corpus) catch."""
    return {}


@pytest.mark.parametrize("bug", BOUNDARY_BUGS, ids=[bug.name for bug in BOUNDARY_BUGS])
def test_a_boundary_bug_is_caught_by_the_validations_compare_runs(
    bug, tmp_path, monkeypatch, caught_by_l2_alone
):
    bug.inject(monkeypatch)
    l2 = [builtin_workload(name) for name in BACK_TO_BACK_WORKLOADS]
    caught_by_l2_alone[bug.name] = diverges(l2, tmp_path, shared=True)
    if not caught_by_l2_alone[bug.name]:
        assert diverges(corpus_workloads(CORPUS_DIR), tmp_path, shared=False), bug.name


def test_the_l2_traces_alone_miss_boundary_bugs_the_corpus_catches(caught_by_l2_alone):
    """Runs after the parametrized test above (pytest keeps file order)."""
    assert len(caught_by_l2_alone) == len(BOUNDARY_BUGS)
    missed = [name for name, caught in caught_by_l2_alone.items() if not caught]
    assert (
        "plan: alloc refuses an exact fit" in missed
        and "legacy: the last retry is refused" in missed
    )
