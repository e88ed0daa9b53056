"""The copy patterns of one batch of page copies: the shapes ``copy_runs`` issues differently,
named so that a run can count which ones it issued, per direction (``store``: GPU -> host,
``load``: host -> GPU).

    pattern        the batch (pairs src_ids[i] -> dst_ids[i])             copy_runs issues
    -------------  -----------------------------------------------------  ----------------------
    single         one page                                               one memcpy / DMA
    consecutive    a run of >= 2 pairs consecutive on both sides          one memcpy / DMA a run
    scattered_src  >= 2 pages; the dst ids a consecutive range, the src   a memcpy a run (host),
                   ids not                                                gathers or scatters (GPU)
    scattered_dst  >= 2 pages; the src ids a consecutive range, the dst   a memcpy a run (host),
                   ids not                                                gathers or scatters (GPU)
    shuffled       >= 2 pages, neither one run nor scattered: both sides  a memcpy a page (host),
                   scattered, or ranges in another order                  gathers and scatters
    split          a host-to-host batch the pool's ``CopySplit`` gives    shares on copy threads
                   more than one thread

Every batch of two or more pages is one run, ``scattered_src``, ``scattered_dst`` or ``shuffled``;
``consecutive`` and ``split`` come on top. Ids: ``copy.<direction>.<pattern>``
(``COPY_PATTERN_IDS``). Runs are counted here apart from ``copy_runs.pair_runs``, so that a bug in
how the copy cuts runs does not also rename what it was asked to copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchgen.kv.copy_runs import CopySplit

DIRECTIONS = ("store", "load")
PATTERNS = ("single", "consecutive", "scattered_src", "scattered_dst", "shuffled", "split")
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
        num_runs = _num_runs(src, dst)
        if num_runs < len(src):
            shown.append("consecutive")
        if _is_range(src) != _is_range(dst):
            shown.append("scattered_src" if _is_range(dst) else "scattered_dst")
        elif num_runs > 1:
            shown.append("shuffled")
    if host_to_host and split.threads_for(len(src) * page_bytes) > 1:
        shown.append("split")
    return [f"copy.{direction}.{pattern}" for pattern in shown]


def _num_runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Runs of pairs consecutive on both sides (destinations unique): a pair ``s -> d`` starts one
    unless ``s - 1 -> d - 1`` is a pair too. Pure."""
    pairs = set(zip(src.tolist(), dst.tolist()))
    return sum((s - 1, d - 1) not in pairs for s, d in pairs)


def _is_range(page_ids: np.ndarray) -> bool:
    """Whether the ids, sorted, count up by one. Pure."""
    ordered = np.sort(page_ids)
    return bool((np.diff(ordered) == 1).all())
