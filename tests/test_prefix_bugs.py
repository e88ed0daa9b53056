"""The prefix-caching bugs of the catalog (``known_bugs.PREFIX_BUGS``), each caught the way
``batchgen validate --fail-fast`` runs corpus-08, the prefix-caching corpus file: a fresh
compare-mode worker, legacy serving with the plan shadowed, the page-content oracle on, every check
of a corpus run (``test_validate_mutants.run_as_validate_does``).

    a  a shared page freed while another request holds it     evict: fewer victims than needed
    b  a cache entry reused after its page was overwritten    alloc: a page shared and new at once
    c  a load into a page still cached for another prefix     migrate: the plan refused (plan);
                                                              wrong pages loaded into (legacy)

Each is injected process-wide (undone after its test); the first failure names what caught it.
"""

from __future__ import annotations

import pytest
from injected_bugs import PREFIX_BUGS
from test_validate_mutants import run_as_validate_does

from batchgen.kv.known_bugs import DEMO_BUGS, demo_bug
from batchgen.model.loader import load_model
from batchgen.validation.validate import CORPUS_DIR, corpus_workloads

SHADOW_DIVERGED = (
    "corpus-08 legacy/plan: 1 divergence of the plan shadow from the authoritative legacy path"
)
# bug -> how the first failure of corpus-08 begins
CAUGHT = {
    "plan: eviction counts a victim's shared pages as freed": (
        f"{SHADOW_DIVERGED} (evict: 1); first: evict step 3, state at copies[1].dst_page_ids[0]"
    ),
    "legacy: eviction counts a victim's shared pages as freed": (
        f"{SHADOW_DIVERGED} (evict: 1); first: evict step 3, state at copies[1].dst_page_ids[0]"
    ),
    "plan: a prefix hit is not cut at a page the batch took as new": (
        f"{SHADOW_DIVERGED} (alloc: 1); first: alloc step 136, invalid_plan: plan raised"
        " PlanRejected: AllocPlan.grants[0].new_page_ids: page 36 is granted new and shared as a"
        " cached page in the gpu pool"
    ),
    # the authoritative path itself raises: the worker stops there
    "legacy: the batch's prefix hits looked up before its allocations": (
        "corpus-08 legacy/plan: raised at step 136: PageOwnershipError: gpu: page 36 holds no"
        " cached prefix (it has no digest)"
    ),
    "plan: new pages do not skip the cache entries the plan shares": (
        f"{SHADOW_DIVERGED} (migrate: 1); first: migrate step 4, invalid_plan: plan raised"
        " PlanRejected: MigrationPlan.loads[1].gpu_page_ids: page 27 is granted new and shared as"
        " a cached page in the gpu pool"
    ),
    "legacy: a load re-links cached pages past the first uncached digest": (
        f"{SHADOW_DIVERGED} (migrate: 1); first: migrate step 43, state at"
        " copies[0].dst_page_ids[0]"
    ),
}


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture(scope="module")
def corpus_08():
    return next(w for w in corpus_workloads(CORPUS_DIR) if w.name == "corpus-08")


def test_corpus_08_passes_without_a_bug(model, corpus_08, tmp_path):
    assert run_as_validate_does(model, corpus_08, tmp_path) == []


@pytest.mark.parametrize("bug", PREFIX_BUGS, ids=lambda bug: bug.name)
def test_corpus_08_catches_the_prefix_caching_bug(bug, model, corpus_08, monkeypatch, tmp_path):
    bug.inject(monkeypatch)
    failures = run_as_validate_does(model, corpus_08, tmp_path)
    assert failures and failures[0].startswith(CAUGHT[bug.name]), failures


def test_each_prefix_caching_bug_is_named_once():
    assert sorted(CAUGHT) == sorted(bug.name for bug in PREFIX_BUGS)


@pytest.mark.parametrize("name", ["shared-pages-freed", "stale-prefix-hit"])
def test_a_prefix_caching_demo_bug_can_be_planted_in_either_path(name):
    assert name in DEMO_BUGS
    plan, legacy = demo_bug(name, "plan"), demo_bug(name, "legacy")
    assert (plan.owner, legacy.owner) == ("KVCacheManager", "LegacyKvPath")
    assert {plan, legacy} <= set(PREFIX_BUGS)
