"""Compare mode's recording wrappers: what one op wrote, recorded around the worker's parts,
which record nothing themselves."""

from batchgen.kv.backends import CompletedHandle, CopyOp, GpuKvPool, HostKvPool
from batchgen.kv.page_pool import PagePool
from batchgen.shadow.forked_pages import ForkedPagePool
from batchgen.shadow.recording import (
    PoolEvent,
    RecordingHostPool,
    RecordingPool,
    recorded,
    start,
    stop,
)
from batchgen.validation.plan_fixture import make_target


def test_a_recording_pool_journals_each_change_of_its_allocator():
    pool = RecordingPool(GpuKvPool(4))
    pool.allocate_pages("x", 1)  # not recording: nothing journaled
    pool.journal = []
    pool.allocate_pages("a", 2)
    pool.take_pages_for([("b", [3]), ("c", [])])
    pool.allocate_pages("d", 0)
    pool.release_pages("a")
    pool.release_pages("nobody")
    assert pool.journal == [
        PoolEvent("alloc", "a", (1, 2)),
        PoolEvent("alloc", "b", (3,)),
        PoolEvent("release", "a", (1, 2)),
    ]
    assert (pool.pool.pages_of("x"), pool.free_pages()) == ((0,), 2)


def test_a_fork_journals_as_the_worker_does():
    base = PagePool("gpu", 8)
    base.allocate_pages("b", 2)
    fork = RecordingPool(GpuKvPool(8, pages=ForkedPagePool(base)))
    fork.journal = []
    fork.allocate_pages("c", 2)
    fork.release_pages("b")
    fork.take_pages("d", [0])
    assert fork.journal == [
        PoolEvent("alloc", "c", (2, 3)),
        PoolEvent("release", "b", (0, 1)),
        PoolEvent("alloc", "d", (0,)),
    ]
    assert base.pages_of("b") == (0, 1)


def test_a_recording_host_pool_records_the_copies_and_load_handles_of_its_ops():
    gpu = GpuKvPool(8)
    host = RecordingHostPool(HostKvPool(4, None, gpu))
    host.copies, host.load_handles = [], {}
    host.allocate_pages("a", 2)
    host.store_from_gpu("a", [5, 6])
    handle = host.load_to_gpu_async("a", [1, 0])
    assert host.copies == [
        CopyOp("store", "a", (5, 6), (0, 1)),
        CopyOp("load", "a", (0, 1), (1, 0)),
    ]
    assert isinstance(handle, CompletedHandle) and host.load_handles == {id(handle): ("a", handle)}


def test_start_records_an_op_on_the_worker_and_stop_forgets_it():
    target = make_target()
    on = recorded(target)
    start(on)
    on.drop_pending_append("run1")
    on.gpu_kv.release_pages("run0")
    assert (on.dropped, "run1" in target.pending_appends) == ({"run1"}, False)
    assert on.gpu_kv.journal == [PoolEvent("release", "run0", (0, 1))]
    stop(on)
    assert (on.dropped, on.state.written, on.gpu_kv.journal, on.host_kv.copies) == (
        None,
        None,
        None,
        None,
    )
