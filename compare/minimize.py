"""Delta debugging: shrink a failing input (a sequence of ops, requests, ...) to a minimal one.

Zeller and Hildebrandt's ddmin ("Simplifying and Isolating Failure-Inducing Input", 2002): split
the current failing subsequence into n chunks; keep a chunk that still fails (back to n = 2), or
else a complement that still fails (n - 1); else refine to 2n chunks; stop when the chunks are
single items. The result is 1-minimal: removing any one item makes it pass. `still_fails` should
check the failure's signature (same op, same kind), not just "something failed", or ddmin may
wander to a different failure.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class _Budget(Exception):
    """Raised inside `ddmin` when `max_tests` calls of `still_fails` are used up."""


def ddmin(
    items: Sequence[T],
    still_fails: Callable[[Sequence[T]], bool],
    *,
    max_tests: int = 2000,
    interchangeable: bool = False,
) -> list[T]:
    """Return a 1-minimal subsequence of `items` (order kept) for which `still_fails` holds.

    ValueError if `still_fails(items)` is false. Each distinct subsequence is tested once;
    `interchangeable`: equal items (hashable) are interchangeable for `still_fails`, so two
    subsequences that read the same are one test and repeated items cost no budget. After
    `max_tests` calls it warns and returns the smallest failing subsequence found so far (then
    not necessarily 1-minimal). Mutates nothing; `still_fails` receives new lists.
    """
    if max_tests < 1:
        raise ValueError(
            f"max_tests must be >= 1 (the input itself is tested first), not {max_tests}"
        )
    tested: dict[tuple, bool] = {}

    def fails(indices: list[int]) -> bool:
        key = tuple(items[i] for i in indices) if interchangeable else tuple(indices)
        if key not in tested:
            if len(tested) >= max_tests:
                raise _Budget
            tested[key] = bool(still_fails([items[i] for i in indices]))
        return tested[key]

    current = list(range(len(items)))
    if not fails(current):
        raise ValueError("ddmin needs a failing input, but still_fails(items) is false")
    current, exhausted = _reduce(current, fails)
    try:
        if not exhausted and len(current) == 1 and fails([]):  # the last item may not be needed
            current = []
    except _Budget:
        exhausted = True
    if exhausted:
        warnings.warn(
            f"ddmin stopped after {max_tests} tests; the result of "
            f"{len(current)} items may not be minimal",
            stacklevel=2,
        )
    return [items[i] for i in current]


def _reduce(current: list[int], fails: Callable[[list[int]], bool]) -> tuple[list[int], bool]:
    """ddmin's loop over index lists: a failing chunk (n back to 2), else a failing complement
    (n - 1), else 2n chunks, until the chunks are single items. Returns the smallest failing list
    it reached, and whether the test budget ran out first."""
    n = 2
    try:
        while len(current) >= 2:
            chunks = _split(current, n)
            subset = next((chunk for chunk in chunks if fails(chunk)), None)
            if subset is not None:
                current, n = subset, 2
                continue
            if n > 2:  # with two chunks, the complements are the chunks themselves
                complements = (_complement(chunks, k) for k in range(n))
                complement = next((rest for rest in complements if fails(rest)), None)
                if complement is not None:
                    current, n = complement, n - 1
                    continue
            if n >= len(current):
                break
            n = min(2 * n, len(current))
    except _Budget:
        return current, True
    return current, False


def _split(indices: list[int], n: int) -> list[list[int]]:
    """Split into n contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(indices), n)
    chunks, start = [], 0
    for k in range(n):
        end = start + size + (1 if k < extra else 0)
        chunks.append(indices[start:end])
        start = end
    return chunks


def _complement(chunks: list[list[int]], k: int) -> list[int]:
    """Every chunk but the k-th, in order."""
    return [index for j, chunk in enumerate(chunks) if j != k for index in chunk]
