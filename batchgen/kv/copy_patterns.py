"""The copy patterns of one batch of page copies: the shapes ``copy_runs`` issues differently,
named so that a run can count which ones it issued, per direction (``store``: GPU -> host,
``load``: host -> GPU).

    pattern      the batch (pairs src_ids[i] -> dst_ids[i])               copy_runs issues
    -----------  -------------------------------------------------------  -----------------------
    single       one page                                                 one memcpy / DMA
    consecutive  a run of >= 2 pairs consecutive on both sides            one memcpy / DMA a run
    scattered    >= 2 pages; one side's ids a consecutive range, the      gathers or scatters
                 other's not
    shuffled     >= 2 pages, neither one run nor scattered: both sides    a memcpy a page (host),
                 scattered, or ranges in another order                    gathers and scatters
    split        a host-to-host batch the pool's ``CopySplit`` gives more  shares on copy threads
                 than one thread

Every batch of two or more pages is one run, ``scattered`` or ``shuffled``; ``consecutive`` and
``split`` come on top. Ids: ``copy.<direction>.<pattern>`` (``COPY_PATTERN_IDS``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchgen.kv.copy_runs import CopySplit, pair_runs

DIRECTIONS = ("store", "load")
PATTERNS = ("single", "consecutive", "scattered", "shuffled", "split")
COPY_PATTERN_IDS = tuple(f"copy.{d}.{p}" for d in DIRECTIONS for p in PATTERNS)


def issuable_patterns(*, host_to_host: bool) -> tuple[str, ...]:
    """The pattern ids copies between the tiers can issue: all, or, with a GPU involved (no copy
    threads there), all but ``split``. Pure."""
    return tuple(p for p in COPY_PATTERN_IDS if host_to_host or not p.endswith(".split"))


def copy_patterns(
    direction: str,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    *,
    page_bytes: int,
    host_to_host: bool,
    split: CopySplit,
) -> list[str]:
    """The pattern ids (``copy.<direction>.<pattern>``) the batch shows, in ``PATTERNS`` order.
    ``host_to_host``: both pools on the CPU, where a large batch is split. Pure."""
    src, dst = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
    shown = []
    if len(src) == 1:
        shown.append("single")
    elif len(src) > 1:
        _, _, lengths = pair_runs(src, dst)
        if lengths.max() >= 2:
            shown.append("consecutive")
        if _is_range(src) != _is_range(dst):
            shown.append("scattered")
        elif len(lengths) > 1:
            shown.append("shuffled")
    if host_to_host and split.threads_for(len(src) * page_bytes) > 1:
        shown.append("split")
    return [f"copy.{direction}.{pattern}" for pattern in shown]


def _is_range(page_ids: np.ndarray) -> bool:
    """Whether the ids, sorted, count up by one. Pure."""
    ordered = np.sort(page_ids)
    return bool((np.diff(ordered) == 1).all())
