"""The page tensors of both KV tiers, refused before any page is allocated when memory is short.

::

    GPU tier   [num_gpu_pages,  L, 2, kv_heads, page_size, head_dim]  on the worker's device
    host tier  [num_host_pages, L, 2, kv_heads, page_size, head_dim]  CPU, pinned with CUDA
"""

from __future__ import annotations

import math

import torch

from batchgen.config import CacheConfig, ModelConfig
from batchgen.kv.page_copy import new_page_tensor
from batchgen.model.loader import SUPPORTED_DTYPES, device_memory_available
from batchgen.model.paged_kv import kv_page_shape

LOWER_POOLS = "lower num_gpu_pages/num_host_pages (or page_size)"


class PoolAllocationError(ValueError):
    """The KV page pools do not fit in memory."""


def tier_tensors(
    model: ModelConfig, cache: CacheConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tiers' page tensors, reading as zeros; PoolAllocationError (sizes named) when memory
    refuses, or would: a pool past the memory available would have the OS kill the process part
    way through a job that fills it."""
    dtype = SUPPORTED_DTYPES[cache.dtype]
    shape = kv_page_shape(model, cache.page_size, cache.num_gpu_pages)
    host_shape = (cache.num_host_pages, *shape[1:])
    host = torch.device("cpu")
    page_bytes = math.prod(shape[1:]) * torch.finfo(dtype).bits // 8
    check_pool_memory(
        {"GPU-tier": (shape[0], device), "host-tier": (host_shape[0], host)}, page_bytes
    )
    tensors = []
    for tier_shape, tier_device, pinned in (
        (shape, device, False),
        (host_shape, host, device.type == "cuda"),
    ):
        try:
            tensors.append(
                new_page_tensor(tier_shape, dtype=dtype, device=tier_device, pin_memory=pinned)
            )
        except (RuntimeError, MemoryError) as error:
            raise PoolAllocationError(
                f"cannot allocate {tier_shape[0]} KV pages"
                f" ({tier_shape[0] * page_bytes / 2**30:.1f} GiB) on {tier_device}:"
                f" {str(error).splitlines()[0]}; {LOWER_POOLS}"
            ) from None
    return tensors[0], tensors[1]


def check_pool_memory(tiers: dict[str, tuple[int, torch.device]], page_bytes: int) -> None:
    """PoolAllocationError when the tiers' pages (tier name -> page count, device) need more than
    a device has available: Linux's MemAvailable for the CPU (both tiers there on a CPU run), the
    free memory of a GPU; no check where neither is known. Pure."""
    for device in dict.fromkeys(device for _, device in tiers.values()):
        available = device_memory_available(device)
        on_device = {
            name: num_pages
            for name, (num_pages, tier_device) in tiers.items()
            if tier_device == device
        }
        num_bytes = sum(on_device.values()) * page_bytes
        if available is not None and num_bytes > available:
            pages = " + ".join(f"{num_pages} {name}" for name, num_pages in on_device.items())
            raise PoolAllocationError(
                f"the KV pools need {num_bytes / 2**30:.1f} GiB on {device} ({pages} pages of"
                f" {page_bytes} bytes), {available / 2**30:.1f} GiB is available; {LOWER_POOLS}"
            )
