"""Known bugs of the KV paths, planted on purpose: the one catalog the tests inject from and compare
mode's demo switch (``--kv-compare-demo-bug NAME``, ``BATCHGEN_WORKER_KV_COMPARE_DEMO_BUG``) plants.

A bug is a real function's source with one small edit, recompiled (``mutate``). The boundary bugs
flip one comparison at an ``==`` boundary of the KV policy, on either path. A bug with a demo name
has a variant on each path, a method of the plan path's manager or of the legacy path, so the
demo switch can plant it in whichever path is the shadow, on that one object (``plant``): the
authoritative path, and so the job's output, stay right. Tests ``inject`` a bug process-wide.

    demo name            what the shadow path then does            shows on smoke
    reversed-grants      hands out each grant's pages in reverse    alloc, 6 times
    evict-at-watermark   evicts on at the watermark                 evict, twice
    migrate-exact-fit    refuses a load that fits exactly           migrate, twice
    alloc-exact-fit      refuses an allocation that fits exactly    no (L2 traces, corpus)
    host-exact-fit       calls a host pool with exactly enough full no (L2 traces, corpus)
    shared-pages-freed   counts a victim's shared pages as freed    no (shared-prefix: evict, 10)
    stale-prefix-hit     shares a cached page an earlier request of no (corpus-08: alloc, once)
                         the batch took as a new page

The prefix-caching bugs (``PREFIX_BUGS``, each caught as ``tests/test_prefix_bugs.py`` shows):

    a  a shared page freed while another request holds it: eviction counts every victim page
       as freed (shared-pages-freed)
    b  a cache entry reused after its page was overwritten: a hit not cut where an earlier
       request of the batch took its page as new (stale-prefix-hit)
    c  a load into a page still cached for another prefix: the plan's new pages not skipping
       the cache entries it shares; legacy: a load re-linking past the first uncached digest

The legacy path's module is reached through the gate (``kv_path_class``), imported only when a
legacy bug is injected or planted.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from types import MethodType
from typing import Any, Protocol

from batchgen.kv import manager as kv_manager


class Patcher(Protocol):
    """What ``KnownBug.inject`` sets attributes through (``pytest.MonkeyPatch``: undone later)."""

    def setattr(self, target: Any, name: str, value: Any) -> None: ...


def mutate(func: Callable, old: str, new: str) -> Callable:
    """``func`` recompiled from its source with ``old`` (which must occur once) replaced by
    ``new``; ValueError naming the function when it does not. The mutant runs in a copy of the
    function's module globals, so it sees (and calls) exactly what the original does. Reads the
    function's source file."""
    source = textwrap.dedent(inspect.getsource(func))
    if source.count(old) != 1:
        raise ValueError(
            f"mutant anchor {old!r} occurs {source.count(old)} times in {func.__qualname__}; "
            "the code changed: update the mutant"
        )
    namespace = dict(func.__globals__)
    exec(compile(source.replace(old, new), f"<mutant of {func.__qualname__}>", "exec"), namespace)
    return namespace[func.__name__]


@dataclass(frozen=True)
class KnownBug:
    """``old`` -> ``new`` in ``owner.function`` on ``path``; ``owner`` is ``KVCacheManager``,
    ``_FreePages`` (a plan's view of the free queue), the ``manager`` module or ``LegacyKvPath``.
    Only a method of ``KVCacheManager`` or ``LegacyKvPath`` can be planted (a demo bug)."""

    name: str  # what it breaks, e.g. "plan: alloc refuses an exact fit"
    path: str  # the KV path it breaks: "plan" or "legacy"
    owner: str
    function: str
    old: str
    new: str
    demo: str | None = None  # its demo switch name, shared with its variant on the other path
    boundary: bool = True  # one comparison flipped at an == boundary of the policy

    def owner_object(self) -> Any:
        """The class or module holding the function (the legacy path imported here)."""
        if self.owner == "LegacyKvPath":
            from batchgen.kv.gate import kv_path_class

            return kv_path_class("legacy")
        return kv_manager if self.owner == "manager" else getattr(kv_manager, self.owner)

    def mutant(self) -> Callable:
        """The mutated function, compiled once per bug."""
        return _mutant(self)

    def inject(self, patcher: Patcher) -> None:
        """Replace the function process-wide, on both paths' objects alike, through ``patcher``
        (which undoes it). Mutates the owner."""
        patcher.setattr(self.owner_object(), self.function, self.mutant())

    def plant(self, kv_path: Any) -> None:
        """Replace the method on this one path object: the plan path's ``manager``, or the legacy
        path itself; every other object keeps the right one. Mutates ``kv_path``."""
        holder = kv_path.manager if self.path == "plan" else kv_path
        setattr(holder, self.function, MethodType(self.mutant(), holder))


@functools.cache
def _mutant(bug: KnownBug) -> Callable:
    return mutate(getattr(bug.owner_object(), bug.function), bug.old, bug.new)


def _b(name: str, owner: str, function: str, old: str, new: str, demo: str | None = None):
    """A boundary bug; its path is its name's prefix."""
    return KnownBug(name, name.split(":")[0], owner, function, old, new, demo)


# legacy allocate's loop head and hit lookup (its source, dedented), and the lookups hoisted out
_LOOKUP_IN_LOOP = """    for uuid in batch:
        req = self.state.requests[uuid]
        admitting = req.phase is not Phase.RUNNING
        # decision: alloc.prefix_hit, alloc.prefix_hit.cache_entry
        hits = self._prefix_hits(req) if admitting else []
"""
_LOOKUP_BEFORE_LOOP = """    hits_of = {u: self._prefix_hits(self.state.requests[u]) for u in batch}
    for uuid in batch:
        req = self.state.requests[uuid]
        admitting = req.phase is not Phase.RUNNING
        hits = hits_of[uuid] if admitting else []
"""

# the prefix-caching bugs a, b, c (the docstring's table), each on both paths
PREFIX_BUGS = (
    KnownBug("plan: eviction counts a victim's shared pages as freed", "plan", "KVCacheManager",
             "plan_eviction", "drop_holds(running.gpu_page_ids[i], holders)",
             "drop_holds(running.gpu_page_ids[i], {})", "shared-pages-freed", boundary=False),
    KnownBug("legacy: eviction counts a victim's shared pages as freed", "legacy", "LegacyKvPath",
             "evict", "if self.gpu_kv.holders(p) == 1)", "if self.gpu_kv.holders(p) >= 1)",
             "shared-pages-freed", boundary=False),
    KnownBug("plan: a prefix hit is not cut at a page the batch took as new", "plan",
             "KVCacheManager", "plan_allocation", "hits = free.hits(prefix)", "hits = prefix",
             "stale-prefix-hit", boundary=False),
    KnownBug("legacy: the batch's prefix hits looked up before its allocations", "legacy",
             "LegacyKvPath", "allocate", _LOOKUP_IN_LOOP, _LOOKUP_BEFORE_LOOP, "stale-prefix-hit",
             boundary=False),
    KnownBug("plan: new pages do not skip the cache entries the plan shares", "plan",
             "_FreePages", "take_new", "if page_id not in self._shared:",
             "if page_id not in self._new:", boundary=False),
    KnownBug("legacy: a load re-links cached pages past the first uncached digest", "legacy",
             "LegacyKvPath", "migrate", "relinked = self.gpu_kv.cached_prefix(req.prompt_digests)",
             "relinked = [p for d in req.prompt_digests for p in self.gpu_kv.cached_prefix([d])]",
             boundary=False),
)  # fmt: skip

KNOWN_BUGS = (
    _b("plan: alloc refuses an exact fit", "KVCacheManager", "plan_allocation",
       "if cost > free.num_free:", "if cost >= free.num_free:", "alloc-exact-fit"),
    _b("plan: eviction goes on at the watermark", "KVCacheManager", "plan_eviction",
       "if free_gpu - demand >= watermark:", "if free_gpu - demand > watermark:",
       "evict-at-watermark"),
    _b("plan: a host pool with exactly the victim's pages is full", "KVCacheManager",
       "plan_eviction", "if free_host >= num_pages:", "if free_host > num_pages:",
       "host-exact-fit"),
    _b("plan: migration refuses a load that fits exactly", "KVCacheManager", "plan_migration",
       "if free.num_free - demand - num_new - free.sharing_cost(relinked) < watermark:",
       "if free.num_free - demand - num_new - free.sharing_cost(relinked) <= watermark:",
       "migrate-exact-fit"),
    _b("plan: the last retry is refused", "manager", "_poll_decision",
       "if num_retries < geometry.max_load_retries:",
       "if num_retries + 1 < geometry.max_load_retries:"),
    _b("plan: one retry too many", "manager", "_poll_decision",
       "if num_retries < geometry.max_load_retries:",
       "if num_retries <= geometry.max_load_retries:"),
    _b("plan: the watermark rounded down", "manager", "eviction_watermark_pages",
       "math.ceil(", "math.floor("),
    _b("legacy: alloc refuses an exact fit", "LegacyKvPath", "allocate",
       "if cost > self.gpu_kv.free_pages():", "if cost >= self.gpu_kv.free_pages():",
       "alloc-exact-fit"),
    _b("legacy: eviction goes on at the watermark", "LegacyKvPath", "evict",
       "free - demand < self._kv_watermark_pages", "free - demand <= self._kv_watermark_pages",
       "evict-at-watermark"),
    _b("legacy: a host pool with exactly the victim's pages is full", "LegacyKvPath",
       "_evict_one", "if self.host_kv.free_pages() >= num_pages:",
       "if self.host_kv.free_pages() > num_pages:", "host-exact-fit"),
    _b("legacy: migration refuses a load that fits exactly", "LegacyKvPath", "migrate",
       "if free - demand - cost < self._kv_watermark_pages:",
       "if free - demand - cost <= self._kv_watermark_pages:", "migrate-exact-fit"),
    _b("legacy: the last retry is refused", "LegacyKvPath", "poll",
       "if req.num_load_retries < self.engine_config.max_load_retries:",
       "if req.num_load_retries + 1 < self.engine_config.max_load_retries:"),
    KnownBug("plan: grants' pages in reverse order", "plan", "KVCacheManager", "plan_allocation",
             "PageGrant(uuid, tuple(free.take_new(need)), tuple(hits))",
             "PageGrant(uuid, tuple(free.take_new(need))[::-1], tuple(hits))",
             "reversed-grants", boundary=False),
    KnownBug("legacy: grants' pages in reverse order", "legacy", "LegacyKvPath", "allocate",
             "tuple(self.gpu_kv.allocate_pages(uuid, need))",
             "tuple(self.gpu_kv.allocate_pages(uuid, need))[::-1]",
             "reversed-grants", boundary=False),
    *PREFIX_BUGS,
)  # fmt: skip

BOUNDARY_BUGS = tuple(bug for bug in KNOWN_BUGS if bug.boundary)
# the demo switch's names, in catalog order
DEMO_BUGS = tuple(dict.fromkeys(bug.demo for bug in KNOWN_BUGS if bug.demo is not None))


def demo_bug(name: str | None, path: str) -> KnownBug | None:
    """The variant of demo bug ``name`` on ``path`` (the shadow path it is planted in), None for
    no name; ValueError naming the known ones for an unknown name. Pure."""
    if name is None:
        return None
    for bug in KNOWN_BUGS:
        if bug.demo == name and bug.path == path:
            return bug
    raise ValueError(f"unknown demo bug {name!r}; known: {', '.join(DEMO_BUGS)}")
