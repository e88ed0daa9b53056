"""What a batch of page copies must be before ``copy_runs`` issues it: two pools of the same page
shape and dtype, contiguous, not sharing memory, not on two GPUs; as many src ids as dst ids, each
inside its pool, no destination twice. A batch that is not is refused with a ValueError naming
the first id or pool that breaks it (an id that is not an integer: TypeError)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
from torch import Tensor


def checked_copy_ids(
    src: Tensor, src_ids: Sequence[int], dst: Tensor, dst_ids: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """The ids as int64 arrays, after checking the pools and ids fit together; mutates nothing."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"pages differ: src is {src.dtype}{list(src.shape[1:])}, dst is"
            f" {dst.dtype}{list(dst.shape[1:])}"
        )
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("pools must be contiguous tensors (page outermost)")
    if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
        raise ValueError("src and dst share memory; copy_pages moves pages between two pools")
    if src.is_cuda and dst.is_cuda and src.device != dst.device:
        raise ValueError(
            f"src is on {src.device} and dst on {dst.device}; copies between GPUs are not supported"
        )
    src_index, dst_index = _int_array(src_ids), _int_array(dst_ids)
    if len(src_index) != len(dst_index):
        raise ValueError(f"src_ids has {len(src_index)} ids but dst_ids has {len(dst_index)}")
    for name, index, pool in (("src_ids", src_index, src), ("dst_ids", dst_index, dst)):
        if len(index) and (index.min() < 0 or index.max() >= pool.shape[0]):
            position = int(np.flatnonzero((index < 0) | (index >= pool.shape[0]))[0])
            raise ValueError(
                f"{name}[{position}] = {index[position]} is outside the pool's pages "
                f"0..{pool.shape[0] - 1}"
            )
    if len(np.unique(dst_index)) != len(dst_index):
        seen: set[int] = set()
        position = next(p for p, i in enumerate(dst_index.tolist()) if i in seen or seen.add(i))
        raise ValueError(f"dst_ids[{position}] = {dst_index[position]} repeats a destination page")
    return src_index, dst_index


def _int_array(ids: Sequence[int]) -> np.ndarray:
    """``ids`` as an int64 array; TypeError (from ``operator.index``) for an id that is not an
    integer."""
    array = np.asarray(ids)
    if array.ndim == 1 and array.dtype.kind in "iu":  # integers already: nothing to check per id
        return array.astype(np.int64, copy=False)
    return np.array([operator.index(i) for i in ids], dtype=np.int64)
