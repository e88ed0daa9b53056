"""Prefix caching end to end: the ``shared-prefix`` workload with the tiny model, in compare mode
raise in both directions, integrity checked every step, with caching on and off and under a
fault spec: the same tokens, hits only with caching on, no divergence. The policy op by op:
``test_prefix_caching.py``."""

from __future__ import annotations

import json

import pytest

from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import run_workload
from batchgen.engine.workloads import builtin_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker
from batchgen.validation.validate import CORPUS_DIR

FAULTS = json.loads((CORPUS_DIR / "corpus-08.json").read_text())["faults"]
PREFIX_OUTCOMES = {"alloc.prefix_hit", "evict.shared_page_kept", "migrate.relink"}
SHADOW = {"plan": "legacy", "legacy": "plan"}


@pytest.fixture(scope="module")
def shared_prefix_runs(tmp_path_factory):
    """The shared-prefix workload (scale 0.3: 18 requests) with the tiny model, compare mode
    raise, integrity checked every step: (faults, caching, authoritative path) -> its result."""
    model, workload = load_model("tiny"), builtin_workload("shared-prefix", scale=0.3)
    log = tmp_path_factory.mktemp("prefix") / "divergences.jsonl"
    results = {}
    for faults in (None, FAULTS):
        for caching in (True, False):
            cache = workload.cache.model_copy(update={"enable_prefix_caching": caching})
            for path in SHADOW:
                gate = KvGateConfig(path=path, compare="raise", compare_log=str(log))
                injector = FaultInjector(FaultSpec.parse(faults)) if faults else None
                worker = gated_worker(
                    model, cache_config=cache, engine_config=workload.engine, kv_gate=gate,
                    faults=injector,
                )  # fmt: skip
                result = run_workload(worker, workload, check_integrity=True)
                results[faults, caching, path] = result
    return results


@pytest.mark.parametrize("faults", [None, FAULTS], ids=["no-faults", "faults"])
def test_the_shared_prefix_workload_gives_the_same_tokens_with_caching_on_and_off(
    shared_prefix_runs, faults
):
    runs = {key[1:]: result for key, result in shared_prefix_runs.items() if key[0] == faults}
    tokens = {
        key: {uuid: (out.phase, out.output_ids) for uuid, out in result.outputs.items()}
        for key, result in runs.items()
    }
    assert len(tokens[True, "plan"]) == 18
    assert all(value == tokens[True, "plan"] for value in tokens.values())
    for (caching, path), result in runs.items():
        summary = result.compare_summary
        assert (summary.authoritative, summary.shadow) == (path, SHADOW[path])
        assert summary.steps_compared["alloc"] > 0
        assert (sum(summary.divergences.values()), summary.harness_errors) == (0, 0)
        assert (result.stats.prefix_cache_hits > 0) is caching
        assert PREFIX_OUTCOMES & summary.coverage.keys() == (PREFIX_OUTCOMES if caching else set())
