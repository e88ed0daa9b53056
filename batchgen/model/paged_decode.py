"""Decode attention on CPU that reads each row's K/V from its pages in place (a numba kernel).

The torch path (``paged_attention.attend_decodes``) gathers a padded copy of every row's K/V per
layer and hands it to SDPA: the K/V cross memory three times, padding included, and SDPA splits
these small shapes poorly over threads. Here each (decode row, kv head) is one task, run in
parallel over numba's threads (as many as torch's)::

    for each query head j of the kv head's group, over positions t < start_pos from the pages
    and the new token's own K/V at start_pos:
        score[t] = q_j . k_t * scale
        out_j = sum_t softmax(score)[t] * v_t

Nothing is copied or padded, and no slot past a row's new token is read (an unwritten slot, NaN
or not, cannot reach the output). Sums run in any order (``fastmath`` reassociation, so they
vectorise), as SDPA's blocked sums do in theirs. Pages are float32 or bfloat16 (read as their
int16 bits and widened in the loops: half the bytes); queries of another dtype than float32 are
attended in float32 and come back in their own.

numba's OpenMP threads, like torch's, do not survive a fork: a process forked after the kernel ran
is ended by numba at its first kernel call. Start workers with ``spawn`` or ``forkserver`` (as
``batchgen sweep``'s process backend does), or fork before the first forward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def attends_in_place(kv_pages: Tensor) -> bool:
    """Whether decodes over ``kv_pages`` take this kernel: float32 or bfloat16 pages on a CPU.
    Pure."""
    return kv_pages.device.type == "cpu" and kv_pages.dtype in (torch.float32, torch.bfloat16)


@functools.cache
def kernel():
    """``paged_decode_kernel.attend_pages``, imported at first use: numba and the compiled kernel
    load only in a process that decodes. Cached: each layer's call would run the import
    machinery again."""
    from batchgen.model.paged_decode_kernel import attend_pages

    return attend_pages


@dataclass(frozen=True, slots=True)
class InPlaceDecodes:
    """Every decode row of a forward, attended by the kernel; built once, used by every layer.
    The kernel runs on as many threads as torch did when the plan was built (``use_threads``)."""

    rows: np.ndarray  # [B] int64: packed row of each decode token
    page_tables: np.ndarray  # [B, P] int64, each row's table padded with its first page
    num_cached: np.ndarray  # [B] int64: each row's start_pos, the positions read from pages

    def attend(self, q: Tensor, new_kv: Tensor, kv_pages: Tensor, layer: int, out: Tensor) -> None:
        """The rows' attention over their pages of ``layer`` and their new K/V (rows of ``q`` [N,
        heads, d] and ``new_kv`` [2, N, kv_heads, d]), written into the same rows of ``out`` [N,
        heads, d]. Reads the rows in place, as the projections left them: no copy of a query,
        key or output row. Reads ``kv_pages``; writes those rows of ``out``."""
        if q.dtype != torch.float32 or out.dtype != torch.float32:  # attended in float32
            attended = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            self.attend(q.float(), new_kv.float(), kv_pages, layer, attended)
            rows = torch.from_numpy(self.rows)
            out[rows] = attended[rows].to(out.dtype)
            return
        new_k, new_v = new_kv.numpy()  # numpy's views: cheaper than torch's, once per layer
        # numpy has no bfloat16: its pages go as their bits
        pages = kv_pages.view(torch.int16) if kv_pages.dtype == torch.bfloat16 else kv_pages
        kernel()(
            q.numpy(),
            new_k,
            new_v,
            self.rows,
            pages.numpy(),
            layer,
            self.page_tables,
            self.num_cached,
            np.float32(1 / math.sqrt(q.shape[2])),
            out.numpy(),
        )
