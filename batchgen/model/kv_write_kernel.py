"""``paged_kv.write_kvs`` for float32 or bfloat16 pages on a CPU (bfloat16 as its int16 bits): one
numba kernel walks each write's slots.

torch's path builds index tensors for every new token (its positions, their pages and slots) and
assigns through two advanced indices: about ten small ops, 0.2 ms a 32-row decode step on one
core, for 128 KiB of K/V. Here the positions, pages and slots are the loop itself, and each
``[head_dim]`` row is copied where it goes. The same bytes land in the same slots.

Compiled on first call and cached on disk beside this file, as ``paged_decode_kernel`` is.
"""

from __future__ import annotations

import numba


@numba.njit(cache=True, boundscheck=False)
def write_runs(kv_pages, new_kvs, tables, table_starts, starts, lengths):
    """Write ``lengths[w]`` tokens for each write w, in order the tokens of ``new_kvs`` [layers, 2,
    tokens, kv_heads, head_dim], into positions ``starts[w]`` on of the page table that begins at
    ``tables[table_starts[w]]`` (page ``p // page_size`` of it, slot ``p % page_size``) of
    ``kv_pages`` [page, layer, kv, kv_head, slot, head_dim]. Writes those slots, nothing else."""
    num_layers, num_kv_heads, page_size = new_kvs.shape[0], new_kvs.shape[3], kv_pages.shape[4]
    token = 0
    for write in range(lengths.shape[0]):
        for position in range(starts[write], starts[write] + lengths[write]):
            page = tables[table_starts[write] + position // page_size]
            slot = position % page_size
            for layer in range(num_layers):
                for kv in range(2):
                    for head in range(num_kv_heads):
                        kv_pages[page, layer, kv, head, slot] = new_kvs[layer, kv, token, head]
            token += 1
