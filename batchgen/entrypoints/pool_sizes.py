"""KV pool sizes for a text job, in pages or as a fraction of memory.

Workloads carry their own cache geometry; a text job does not, so its pools are sized here:

    GPU tier   --gpu-pages N, else --gpu-memory-fraction F of the device's available memory
               (the GPU's free memory; on the CPU, MemAvailable), at most what --max-num-seqs
               requests of a full context can hold, at least two full contexts (a request of
               the whole context fits beside the watermark)
    host tier  --host-pages N, else --host-memory-fraction F of the host's MemAvailable, at most
               a quarter of the GPU tier and at least one page, so eviction has somewhere to go
"""

from __future__ import annotations

import torch

from batchgen.config import DTYPE_SIZES, CacheConfig, ModelConfig, pages_needed
from batchgen.model.loader import device_memory_available, host_memory_available

DEFAULT_GPU_FRACTION = 0.3
DEFAULT_HOST_FRACTION = 0.1
HOST_SHARE = 4  # the host tier defaults to at most 1/HOST_SHARE of the GPU tier's pages
# a machine that does not say how much memory it has gets pools of this many full contexts
UNKNOWN_MEMORY_CONTEXTS = 4


def page_bytes(model: ModelConfig, page_size: int, dtype: str) -> int:
    """Bytes of one KV page (K and V of every layer for ``page_size`` tokens). Pure."""
    per_token = model.num_layers * 2 * model.num_kv_heads * model.head_dim * DTYPE_SIZES[dtype]
    return per_token * page_size


def cache_config(
    model: ModelConfig,
    *,
    device: str,
    dtype: str,
    page_size: int = 16,
    max_num_seqs: int = 64,
    gpu_pages: int | None = None,
    host_pages: int | None = None,
    gpu_memory_fraction: float = DEFAULT_GPU_FRACTION,
    host_memory_fraction: float = DEFAULT_HOST_FRACTION,
) -> CacheConfig:
    """The two pools' geometry (see the module docstring); reads the machine's free memory when a
    size is not given in pages."""
    size = page_bytes(model, page_size, dtype)
    context_pages = pages_needed(model.max_context, page_size)
    if gpu_pages is None:
        available = device_memory_available(torch.device(device))
        gpu_pages = _pages_of(available, gpu_memory_fraction, size, context_pages)
        gpu_pages = max(2 * context_pages, min(gpu_pages, max_num_seqs * context_pages))
    if host_pages is None:
        from_memory = _pages_of(host_memory_available(), host_memory_fraction, size, context_pages)
        host_pages = max(1, min(from_memory, gpu_pages // HOST_SHARE))
    return CacheConfig(
        page_size=page_size, num_gpu_pages=gpu_pages, num_host_pages=host_pages, dtype=dtype
    )


def _pages_of(available: int | None, fraction: float, size: int, context_pages: int) -> int:
    """Pages of ``size`` bytes in ``fraction`` of ``available`` bytes (unknown: a few contexts'
    worth). Pure."""
    if available is None:
        return UNKNOWN_MEMORY_CONTEXTS * context_pages
    return int(available * fraction) // size
