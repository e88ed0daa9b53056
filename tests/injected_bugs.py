"""Bugs the tests inject into the KV paths, shared by the test modules (and the script
``scripts/boundary_bugs.py``) that need one: the catalog is ``batchgen.kv.known_bugs``, which the
demo switch plants from too.

A *mutant* is a real function's source with one small edit, recompiled (``mutate``); the
boundary mutants flip one comparison at an ``==`` boundary of the KV policy, on either path; the
prefix-caching ones (``PREFIX_BUGS``) break shared pages, on either path.
"""

from __future__ import annotations

import pytest

from batchgen.kv.known_bugs import BOUNDARY_BUGS, PREFIX_BUGS, KnownBug, demo_bug, mutate

__all__ = ["BOUNDARY_BUGS", "PREFIX_BUGS", "mutate", "prefix_bug", "reversed_grants"]


def reversed_grants(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan path hands out each grant's pages in reverse order: an alloc divergence at the first
    request needing two pages, tokens unchanged (undone by ``monkeypatch.undo()``)."""
    demo_bug("reversed-grants", "plan").inject(monkeypatch)


def prefix_bug(function: str) -> KnownBug:
    """The plan path's prefix-caching bug in ``function`` (e.g. ``take_new``: new pages handed out
    over the cache entries the plan shares)."""
    return next(bug for bug in PREFIX_BUGS if bug.path == "plan" and bug.function == function)
