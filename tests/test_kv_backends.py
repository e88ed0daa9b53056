"""KV tiers: exact bytes through a GPU -> host -> GPU round trip; compare mode's forks and
bookkeeping-only pools copy nothing."""

import hashlib

import pytest
import torch

from batchgen.config import CacheConfig, EngineConfig, ModelConfig
from batchgen.kv.backends import CompletedHandle, CopyOp, GpuKvPool, HostKvPool
from batchgen.kv.page_copy import AsyncCopyQueue
from batchgen.kv.target import KvTarget
from batchgen.model.paged_kv import kv_page_shape
from batchgen.shadow.fork import fork_target
from batchgen.state import WorkerState

CONFIG = ModelConfig(
    vocab_size=16,
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=2,
    head_dim=4,
    max_context=64,
)
PAGE_SIZE = 4


def tiers(num_gpu_pages: int = 8, num_host_pages: int = 6) -> tuple[GpuKvPool, HostKvPool]:
    """Pools with tensors; every GPU page holds distinct random values, host pages zeros."""
    generator = torch.Generator().manual_seed(0)
    gpu_tensor = torch.randn(kv_page_shape(CONFIG, PAGE_SIZE, num_gpu_pages), generator=generator)
    host_tensor = torch.zeros(kv_page_shape(CONFIG, PAGE_SIZE, num_host_pages))
    gpu = GpuKvPool(num_gpu_pages, gpu_tensor)
    return gpu, HostKvPool(num_host_pages, host_tensor, gpu)


def checksums(tensor: torch.Tensor, page_ids) -> list[str]:
    return [
        hashlib.sha256(tensor[page].contiguous().numpy().tobytes()).hexdigest() for page in page_ids
    ]


def test_gpu_to_host_to_gpu_round_trip_keeps_every_byte():
    gpu, host = tiers()
    gpu.allocate_pages("filler", 1)
    gpu_page_ids = gpu.allocate_pages("a", 3)
    assert gpu_page_ids == [1, 2, 3]
    before = checksums(gpu.tensor, gpu_page_ids)
    host_page_ids = host.allocate_pages("a", 3)
    host.store_from_gpu("a", gpu_page_ids)
    assert checksums(host.tensor, host_page_ids) == before
    gpu.release_pages("a")
    gpu.tensor[gpu_page_ids] = float("nan")  # freed pages get overwritten while "a" is on host
    gpu.allocate_pages("other", 2)
    new_page_ids = gpu.allocate_pages("a", 3)
    assert new_page_ids == [6, 7, 1]
    untouched = checksums(gpu.tensor, [0, 2, 3, 4, 5])
    host.load_to_gpu_async("a", new_page_ids).wait()
    assert checksums(gpu.tensor, new_page_ids) == before
    assert checksums(gpu.tensor, [0, 2, 3, 4, 5]) == untouched


def test_round_trip_into_scattered_pages_keeps_page_order():
    gpu, host = tiers()
    gpu_page_ids = gpu.allocate_pages("a", 3)  # [0, 1, 2]
    before = checksums(gpu.tensor, gpu_page_ids)
    host.allocate_pages("a", 3)
    host.store_from_gpu("a", gpu_page_ids)
    gpu.release_pages("a")
    gpu.take_pages("a", [6, 3, 7])
    handle = host.load_to_gpu_async("a", [6, 3, 7])
    handle.wait()
    assert handle.done()
    assert checksums(gpu.tensor, [6, 3, 7]) == before


def test_store_needs_one_host_page_per_gpu_page():
    gpu, host = tiers()
    gpu_page_ids = gpu.allocate_pages("a", 3)
    host.allocate_pages("a", 2)
    with pytest.raises(ValueError, match="^store a: 3 GPU pages but 2 host pages$"):
        host.store_from_gpu("a", gpu_page_ids)


def test_load_needs_one_gpu_page_per_host_page():
    _, host = tiers()
    host.allocate_pages("a", 2)
    with pytest.raises(ValueError, match="^load a: 3 GPU pages but 2 host pages$"):
        host.load_to_gpu_async("a", [0, 1, 2])


def test_a_copy_op_names_the_source_pages_then_the_destination_pages_of_its_direction():
    _, host = tiers()
    host.allocate_pages("a", 2)
    assert host.copy_op("store", "a", [5, 6]) == CopyOp("store", "a", (5, 6), (0, 1))
    assert host.copy_op("load", "a", [3, 2]) == CopyOp("load", "a", (0, 1), (3, 2))


def test_forks_record_copy_ops_and_issue_no_copies():
    gpu, host = tiers()
    gpu_page_ids = gpu.allocate_pages("a", 2)  # [0, 1]
    gpu_before, host_before = gpu.tensor.clone(), host.tensor.clone()
    cache = CacheConfig(page_size=PAGE_SIZE, num_gpu_pages=8, num_host_pages=6)
    fork = fork_target(KvTarget(WorkerState(), gpu, host, {}, CONFIG, cache, EngineConfig()))
    gpu_fork, host_fork = fork.gpu_kv, fork.host_kv
    assert gpu_fork.tensor is None and host_fork.tensor is None
    host_fork.allocate_pages("a", 2)
    host_fork.store_from_gpu("a", gpu_page_ids)
    gpu_fork.release_pages("a")
    handle = host_fork.load_to_gpu_async("a", gpu_fork.allocate_pages("a", 2))
    assert isinstance(handle, CompletedHandle) and handle.done() and handle.wait() is None
    assert host_fork.copies == [
        CopyOp("store", "a", (0, 1), (0, 1)),
        CopyOp("load", "a", (0, 1), (2, 3)),
    ]
    assert torch.equal(gpu.tensor, gpu_before) and torch.equal(host.tensor, host_before)
    assert gpu.pages_of("a") == (0, 1) and host.pages_of("a") == ()


def test_bookkeeping_only_pools_track_pages_and_complete_loads_at_once():
    gpu = GpuKvPool(4)
    host = HostKvPool(3, None, gpu)
    gpu_page_ids = gpu.allocate_pages("a", 2)
    host.allocate_pages("a", 2)
    host.store_from_gpu("a", gpu_page_ids)
    gpu.release_pages("a")
    handle = host.load_to_gpu_async("a", gpu.allocate_pages("a", 2))
    assert isinstance(handle, CompletedHandle) and handle.done()
    assert (gpu.pages_of("a"), host.pages_of("a")) == ((2, 3), (0, 1))
    assert (gpu.free_pages(), host.free_pages()) == (2, 1)
    gpu.check_integrity({"a"})
    host.check_integrity({"a"})


def test_each_host_pool_with_pages_owns_its_copy_queue_and_a_bookkeeping_pool_has_none():
    _, host = tiers()
    _, other_host = tiers()

    assert isinstance(host.copy_queue, AsyncCopyQueue)
    assert host.copy_queue is not other_host.copy_queue
    assert HostKvPool(4, None, GpuKvPool(4)).copy_queue is None
