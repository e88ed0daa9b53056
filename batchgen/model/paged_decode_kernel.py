"""The numba kernel of ``paged_decode``: decode attention reading K/V pages in place.

Compiled on first call, then cached on disk beside this file (numba's ``__pycache__``), so a
later process loads it instead of compiling it again.
"""

from __future__ import annotations

import numba
import numpy as np

# reassociation and contraction let the dot products vectorise; NaN and infinity keep their meaning
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def use_threads(count: int) -> None:
    """Run the next kernel calls on ``count`` of numba's threads (at most as many as it started;
    at least one). Mutates numba's thread count for the calling thread."""
    numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))


@numba.njit(parallel=True, fastmath=FASTMATH, cache=True, boundscheck=False)
def attend_pages(q, new_k, new_v, kv_pages, layer, page_tables, num_cached, scale, out):
    """The kernel, one task per (row, kv head), all the kv head's query heads at each key: ``q``,
    ``out`` [tasks, group, d]; ``new_k``, ``new_v`` [tasks, d]; ``kv_pages`` [page, layer, kv,
    kv_head, slot, d]. Writes ``out``."""
    num_tasks, group, head_dim = q.shape
    num_kv_heads, page_size = kv_pages.shape[3], kv_pages.shape[4]
    blocks = kv_pages.reshape(-1, page_size, head_dim)  # one per (page, layer, kv, kv head)
    blocks_per_page = kv_pages.shape[1] * 2 * num_kv_heads
    for task in numba.prange(num_tasks):
        row, head = task // num_kv_heads, task % num_kv_heads
        num_keys = num_cached[row]
        num_pages = (num_keys + page_size - 1) // page_size
        key_block = 2 * layer * num_kv_heads + head
        value_block = key_block + num_kv_heads
        task_q, task_out = q[task], out[task]
        scores = np.empty((group, num_keys + 1), dtype=np.float32)
        for page in range(num_pages):
            keys = blocks[page_tables[row, page] * blocks_per_page + key_block]
            first = page * page_size
            for slot in range(min(page_size, num_keys - first)):
                for j in range(group):
                    dot = np.float32(0.0)
                    for e in range(head_dim):
                        dot += task_q[j, e] * keys[slot, e]
                    scores[j, first + slot] = dot * scale
        totals = np.empty(group, dtype=np.float32)
        for j in range(group):
            dot = np.float32(0.0)
            for e in range(head_dim):
                dot += task_q[j, e] * new_k[task, e]
            scores[j, num_keys] = dot * scale
            peak = scores[j, 0]
            for t in range(1, num_keys + 1):
                peak = max(peak, scores[j, t])
            total = np.float32(0.0)
            for t in range(num_keys + 1):
                weight = np.exp(scores[j, t] - peak)
                scores[j, t] = weight
                total += weight
            totals[j] = total
            for e in range(head_dim):
                task_out[j, e] = scores[j, num_keys] * new_v[task, e]
        for page in range(num_pages):
            values = blocks[page_tables[row, page] * blocks_per_page + value_block]
            first = page * page_size
            for slot in range(min(page_size, num_keys - first)):
                for j in range(group):
                    weight = scores[j, first + slot]
                    for e in range(head_dim):
                        task_out[j, e] += weight * values[slot, e]
        for j in range(group):
            for e in range(head_dim):
                task_out[j, e] /= totals[j]
