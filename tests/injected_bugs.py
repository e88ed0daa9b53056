"""Plan-layer bugs the tests inject, shared by the test modules that need one."""

from __future__ import annotations

import pytest

from batchgen.kv import manager as kv_manager
from batchgen.kv.plans import AllocPlan, PageGrant


def reversed_grants(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan path hands out each grant's pages in reverse order: an alloc divergence at the first
    request needing two pages, tokens unchanged (undone by ``monkeypatch.undo()``)."""
    correct = kv_manager.KVCacheManager.plan_allocation

    def plan_allocation(self, req):
        plan = correct(self, req)
        return AllocPlan(
            tuple(PageGrant(g.uuid, g.new_page_ids[::-1]) for g in plan.grants), plan.not_fitting
        )

    monkeypatch.setattr(kv_manager.KVCacheManager, "plan_allocation", plan_allocation)
