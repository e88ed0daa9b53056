"""Bugs the tests inject into the KV paths, shared by the test modules (and the script
``scripts/boundary_bugs.py``) that need one.

A *mutant* is a real function's source with one small edit, recompiled (``mutate``); the
boundary mutants flip one comparison at an ``==`` boundary of the KV policy, on either path.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from batchgen.kv import legacy
from batchgen.kv import manager as kv_manager
from batchgen.kv.plans import AllocPlan, PageGrant


def mutate(func: Callable, old: str, new: str) -> Callable:
    """``func`` recompiled from its source with ``old`` (which must occur once) replaced by
    ``new``. The mutant runs in a copy of the function's module globals, so it sees (and calls)
    exactly what the original does."""
    source = textwrap.dedent(inspect.getsource(func))
    assert source.count(old) == 1, (
        f"mutant anchor {old!r} occurs {source.count(old)} times in {func.__qualname__}; "
        "the code changed: update the mutant"
    )
    namespace = dict(func.__globals__)
    exec(compile(source.replace(old, new), f"<mutant of {func.__qualname__}>", "exec"), namespace)
    return namespace[func.__name__]


@dataclass(frozen=True)
class BoundaryBug:
    """One comparison flipped at an ``==`` boundary: ``old`` -> ``new`` in ``owner.name``."""

    name: str
    owner: object  # the class or module holding the function
    function: str
    old: str
    new: str

    def inject(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Mutates ``owner`` until ``monkeypatch`` is undone."""
        original = getattr(self.owner, self.function)
        monkeypatch.setattr(self.owner, self.function, mutate(original, self.old, self.new))


Manager, Legacy = kv_manager.KVCacheManager, legacy.LegacyKvPath
BOUNDARY_BUGS = (
    BoundaryBug("plan: alloc refuses an exact fit", Manager, "plan_allocation",
                "if need > free:", "if need >= free:"),
    BoundaryBug("plan: eviction goes on at the watermark", Manager, "plan_eviction",
                "if free_gpu - demand >= watermark:", "if free_gpu - demand > watermark:"),
    BoundaryBug("plan: a host pool with exactly the victim's pages is full", Manager,
                "plan_eviction", "if free_host >= num_pages:", "if free_host > num_pages:"),
    BoundaryBug("plan: migration refuses a load that fits exactly", Manager, "plan_migration",
                "if free - demand - num_pages < watermark:",
                "if free - demand - num_pages <= watermark:"),
    BoundaryBug("plan: the last retry is refused", kv_manager, "_poll_decision",
                "if num_retries < geometry.max_load_retries:",
                "if num_retries + 1 < geometry.max_load_retries:"),
    BoundaryBug("plan: one retry too many", kv_manager, "_poll_decision",
                "if num_retries < geometry.max_load_retries:",
                "if num_retries <= geometry.max_load_retries:"),
    BoundaryBug("plan: the watermark rounded down", kv_manager, "eviction_watermark_pages",
                "math.ceil(", "math.floor("),
    BoundaryBug("legacy: alloc refuses an exact fit", Legacy, "allocate",
                "if need > self.gpu_kv.free_pages():", "if need >= self.gpu_kv.free_pages():"),
    BoundaryBug("legacy: eviction goes on at the watermark", Legacy, "evict",
                "free - demand < self._kv_watermark_pages",
                "free - demand <= self._kv_watermark_pages"),
    BoundaryBug("legacy: a host pool with exactly the victim's pages is full", Legacy,
                "_evict_one", "if self.host_kv.free_pages() >= num_pages:",
                "if self.host_kv.free_pages() > num_pages:"),
    BoundaryBug("legacy: migration refuses a load that fits exactly", Legacy, "migrate",
                "if free - demand - num_pages < self._kv_watermark_pages:",
                "if free - demand - num_pages <= self._kv_watermark_pages:"),
    BoundaryBug("legacy: the last retry is refused", Legacy, "poll",
                "if req.num_load_retries < self.engine_config.max_load_retries:",
                "if req.num_load_retries + 1 < self.engine_config.max_load_retries:"),
)  # fmt: skip


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
