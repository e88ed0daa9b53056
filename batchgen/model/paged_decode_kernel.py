"""The numba kernel of ``paged_decode``: decode attention reading K/V pages in place.

Compiled on first call, then cached on disk beside this file (numba's ``__pycache__``), so a
later process loads it instead of compiling it again.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

# reassociation and contraction let the dot products vectorise; NaN and infinity keep their meaning
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}

# Cephes' expf: ln 2 in two parts (n * LN2_HI exact for the n here), and its degree-5 polynomial
# of (e**r - 1 - r) / r**2 on [-ln 2 / 2, ln 2 / 2]
LN2_HI, LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
EXP_POLY = tuple(np.float32(c) for c in (1.98756915e-4, 1.39819995e-3, 8.33345191e-3))
EXP_POLY += tuple(np.float32(c) for c in (4.16657959e-2, 1.66666655e-1, 5.00000012e-1))
LOG2E = np.float32(1.4426950408889634)
SMALLEST_EXPONENT = np.float32(-87.33654)  # e**x is under float32's smallest normal below this

# Between a forward's matmuls the pages come from DRAM, where one core's hardware prefetchers
# leave the kernel at about 5 GB/s; asking for keys this many rows ahead (and each value row as
# its key is scored) brings it to about 7, a fifth off its time (docs/benchmarks-engine.md)
KEY_ROWS_AHEAD = 8
CACHE_LINE_BYTES = 64


def use_threads(count: int) -> None:
    """Run the next kernel calls on ``count`` of numba's threads (at most as many as it started;
    at least one), torch's own count left as it was. Mutates numba's thread count for the calling
    thread; starts numba's threads at the first call.

    numba and torch share one OpenMP runtime (both load ``libgomp.so.1``), and starting numba's
    threads sets the runtime's thread count to numba's, one per CPU: a process set to one thread
    would run its matmuls on every CPU from its first decode on. So the threads start here, and
    torch's count is put back."""
    torch_threads = torch.get_num_threads()
    numba.get_num_threads()  # starts numba's threads if they have not started
    torch.set_num_threads(torch_threads)
    numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))


@numba.njit(parallel=True, fastmath=FASTMATH, cache=True, boundscheck=False)
def attend_pages(q, new_k, new_v, rows, kv_pages, layer, page_tables, num_cached, scale, out):
    """The kernel, one task per (decode b, kv head), all the kv head's query heads at each key:
    ``q``, ``out`` [N, heads, d] and ``new_k``, ``new_v`` [N, kv_heads, d] are a forward's packed
    rows, of which decode b is row ``rows[b]`` (any strides: each task copies its own queries and
    new K/V into a contiguous block first); ``kv_pages`` [page, layer, kv, kv_head, slot, d],
    float32, or bfloat16 given as its int16 bits (``as_float32``). Writes the decodes' rows of
    ``out``, nothing else."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_layers, num_kv_heads, page_size = kv_pages.shape[1], kv_pages.shape[3], kv_pages.shape[4]
    group = num_heads // num_kv_heads
    blocks = kv_pages.reshape(-1, page_size, head_dim)  # one per (page, layer, kv, kv head)
    num_tasks = rows.shape[0] * num_kv_heads
    for task in numba.prange(num_tasks):
        decode, head = task // num_kv_heads, task % num_kv_heads
        row, heads = rows[decode], slice(head * group, (head + 1) * group)
        num_keys = num_cached[decode]
        table = _key_blocks(page_tables[decode], layer, head, num_layers, num_kv_heads)
        task_q = np.ascontiguousarray(q[row, heads])
        task_k = np.ascontiguousarray(new_k[row, head])
        task_v = np.ascontiguousarray(new_v[row, head])
        task_out = np.empty((group, head_dim), dtype=np.float32)
        scores = np.empty((group, num_keys + 1), dtype=np.float32)
        totals = np.empty(group, dtype=np.float32)
        if task + 1 < num_tasks:  # most often this thread's next task
            _prefetch_first_keys(task + 1, blocks, layer, page_tables, num_cached, kv_pages.shape)
        _score_keys(task_q, blocks, table, table + num_kv_heads, num_keys, scale, scores)
        _exp_scores_with_new_token(task_q, task_k, task_v, scale, scores, totals, task_out)
        _add_weighted_values(scores, blocks, table + num_kv_heads, num_keys, task_out)
        for j in range(group):
            for e in range(head_dim):
                out[row, head * group + j, e] = task_out[j, e] / totals[j]


@numba.njit(boundscheck=False, inline="always")
def _key_blocks(pages, layer, head, num_layers, num_kv_heads):
    """The blocks of ``attend_pages``'s ``blocks`` that hold kv head ``head``'s keys of ``layer``
    in ``pages`` (a page id, or an array of them); its values are ``num_kv_heads`` blocks on.
    Pure."""
    return (pages * num_layers + layer) * 2 * num_kv_heads + head


@numba.njit(boundscheck=False, inline="always")
def _prefetch_first_keys(task, blocks, layer, page_tables, num_cached, page_shape):
    """Asks for the first ``KEY_ROWS_AHEAD`` keys of ``task`` in ``attend_pages``'s ``blocks``
    of pages of ``page_shape``. Reads nothing."""
    num_layers, num_kv_heads = page_shape[1], page_shape[3]
    decode, head = task // num_kv_heads, task % num_kv_heads
    first_block = blocks[_key_blocks(page_tables[decode, 0], layer, head, num_layers, num_kv_heads)]
    for slot in range(min(KEY_ROWS_AHEAD, num_cached[decode])):
        _prefetch_row(first_block, slot)


@numba.njit(fastmath=FASTMATH, boundscheck=False, inline="always")
def _score_keys(task_q, blocks, key_blocks, value_blocks, num_keys, scale, scores):
    """``scores[j, t]`` = query j . key t * scale for the ``num_keys`` keys of the blocks at
    ``key_blocks`` (one per page), each key's value row (``value_blocks``) asked for as it goes.
    Writes ``scores``."""
    page_size = blocks.shape[1]
    for page in range((num_keys + page_size - 1) // page_size):
        keys, values = blocks[key_blocks[page]], blocks[value_blocks[page]]
        first = page * page_size
        num_slots = min(page_size, num_keys - first)
        for slot in range(num_slots):
            if slot + KEY_ROWS_AHEAD < num_slots:
                _prefetch_row(keys, slot + KEY_ROWS_AHEAD)
            _prefetch_row(values, slot)
            for j in range(task_q.shape[0]):
                dot = np.float32(0.0)
                for e in range(task_q.shape[1]):
                    dot += task_q[j, e] * as_float32(keys[slot, e])
                scores[j, first + slot] = dot * scale


@numba.njit(fastmath=FASTMATH, boundscheck=False, inline="always")
def _exp_scores_with_new_token(task_q, new_k, new_v, scale, scores, totals, task_out):
    """The new token's score in the last column, each row of ``scores`` replaced by its softmax
    numerator (``totals`` the denominators), and ``task_out`` started at the new token's weighted
    value. Writes all three."""
    num_keys = scores.shape[1] - 1
    for j in range(task_q.shape[0]):
        dot = np.float32(0.0)
        for e in range(task_q.shape[1]):
            dot += task_q[j, e] * new_k[e]
        scores[j, num_keys] = dot * scale
        peak = scores[j, 0]
        for t in range(1, num_keys + 1):
            peak = max(peak, scores[j, t])
        total = np.float32(0.0)
        for t in range(num_keys + 1):
            weight = exp_nonpositive(scores[j, t] - peak)
            scores[j, t] = weight
            total += weight
        totals[j] = total
        for e in range(task_q.shape[1]):
            task_out[j, e] = scores[j, num_keys] * new_v[e]


@numba.njit(fastmath=FASTMATH, boundscheck=False, inline="always")
def _add_weighted_values(scores, blocks, value_blocks, num_keys, task_out):
    """``task_out[j] += scores[j, t] * value t`` over the ``num_keys`` values of the blocks at
    ``value_blocks``. Writes ``task_out``."""
    page_size = blocks.shape[1]
    for page in range((num_keys + page_size - 1) // page_size):
        values = blocks[value_blocks[page]]
        first = page * page_size
        for slot in range(min(page_size, num_keys - first)):
            for j in range(task_out.shape[0]):
                weight = scores[j, first + slot]
                for e in range(task_out.shape[1]):
                    task_out[j, e] += weight * as_float32(values[slot, e])


# no reassociation: it would fold n * LN2_HI + n * LN2_LO into one product and lose the split
# (4.5 ulp instead of 1 in the kernel's loop); LLVM still inlines this into the loop and vectorises
@numba.njit(fastmath={"contract", "nsz", "arcp"})
def exp_nonpositive(x):
    """e**x for a float32 x <= 0, within a relative 2**-23 of the exact value (about one ulp)
    down to float32's smallest normal, 0 below it and for -inf, NaN for NaN. Arithmetic only, so
    a loop of it vectorises (libm's ``expf``, which ``np.exp`` calls, is one call per element: a
    fifth of the kernel's time). Pure."""
    clamped = max(x, SMALLEST_EXPONENT)
    n = np.floor(clamped * LOG2E + np.float32(0.5))  # x = n ln 2 + r, |r| <= ln 2 / 2
    r = clamped - n * LN2_HI - n * LN2_LO
    c0, c1, c2, c3, c4, c5 = EXP_POLY
    poly = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5
    power_of_two = _float32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))  # 2**n
    y = (poly * r * r + r + np.float32(1.0)) * power_of_two
    if x < SMALLEST_EXPONENT:
        y = np.float32(0.0)
    if x != x:
        y = x
    return y


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE 754 bits are the int32 ``bits`` (numba has no scalar bit cast)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


def as_float32(x):
    """``x`` as a float32: a float32 itself, an int16 as the bfloat16 whose bits it holds (numba
    has no bfloat16: its pages are read as int16). For the kernel's loops only (``overload``)."""
    raise NotImplementedError("called from numba-compiled code only")


@overload(as_float32, inline="always")
def _as_float32(x):
    if isinstance(x, types.Float):
        return lambda x: x
    if isinstance(x, types.Integer) and x.bitwidth == 16:
        # bfloat16 is float32's upper half: sign-extended or not, the upper 16 bits shift out
        return lambda x: _float32_from_bits(np.int32(x) << np.int32(16))
    return None


@numba.njit(boundscheck=False, inline="always")
def _prefetch_row(block, row):
    """Asks the cache for every line of ``block[row]`` (a C-contiguous 2-d array). Reads
    nothing."""
    for column in range(0, block.shape[1], CACHE_LINE_BYTES // block.itemsize):
        _prefetch(block, row, column)


@intrinsic
def _prefetch(typingctx, array, row, column):
    """LLVM's prefetch of ``array[row, column]``'s cache line for a read (numba has none)."""

    def codegen(context, builder, signature, args):
        array_type, row_type, column_type = signature.args
        indices = [
            context.cast(builder, args[1], row_type, types.intp),
            context.cast(builder, args[2], column_type, types.intp),
        ]
        array_struct = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(
            context, builder, array_type, array_struct, indices, wraparound=False
        )
        byte_pointer = ir.IntType(8).as_pointer()
        int32 = ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32]),
            "llvm.prefetch.p0",
        )
        # read, keep in all cache levels, data cache
        flags = [ir.Constant(int32, 0), ir.Constant(int32, 3), ir.Constant(int32, 1)]
        builder.call(prefetch, [builder.bitcast(pointer, byte_pointer), *flags])
        return context.get_dummy_value()

    return types.void(array, row, column), codegen
