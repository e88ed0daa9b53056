"""Compare mode's own work follows what an op wrote, not how many requests are live.

What compare mode builds for one op, measured exactly at 8 and at 256 live requests: the requests
it copies (the fork's copy-on-write copies and the worker's record of each request before its
first write), whether the fork still shares the worker's request dict, and the leaves of the two
canonical forms it compares. The paths' own reads (evict walks every RUNNING request on either
path) are theirs, not compare mode's. The decision classifier reads only what the op decided.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.engine.worker import Worker
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.plans import (
    EvictionPlan,
    EvictionRequest,
    KvGeometry,
    KvSnapshot,
    MigrationPlan,
    MigrationRequest,
    PageColumns,
    SwappedColumns,
)
from batchgen.model.null_model import NullModel
from batchgen.shadow.coverage import eviction_outcomes, migration_outcomes
from batchgen.shadow.wiring import gated_worker
from batchgen.state import Phase, Request, RequestState
from compare.canonical import flatten

DIRECTIONS = {"plan authoritative": "plan", "legacy authoritative": "legacy"}


def running_worker(num_requests: int, path: str, log) -> Worker:
    """A bookkeeping-only worker in compare mode ("raise") with ``num_requests`` RUNNING requests
    of 20 tokens (two pages each: the next decode steps need no new page) and room for all."""
    worker = gated_worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=CacheConfig(num_gpu_pages=4 * num_requests + 64, num_host_pages=64),
        engine_config=EngineConfig(
            max_num_seqs=num_requests, max_num_batched_tokens=64 * num_requests
        ),
        kv_gate=KvGateConfig(path=path, compare="raise", compare_log=str(log)),
        kv_storage=False,
    )
    for i in range(num_requests):
        worker.add_request(Request(f"r{i}", tuple(range(1, 21)), max_new_tokens=100))
    worker.step()  # admits and prefills all of them
    assert [r.phase for r in worker.state.requests.values()] == [Phase.RUNNING] * num_requests
    return worker


@dataclass(frozen=True)
class HarnessWork:
    """What compare mode built for one op."""

    requests_copied: int  # RequestState.copy calls: fork copies and prior states recorded
    fork_shares_requests: bool  # the fork still reads the worker's request dict
    form_leaves: tuple[int, int]  # leaves of the two canonical forms compared


def harness_work(worker: Worker, op: str, monkeypatch, *args) -> HarnessWork:
    """Run one compared ``op`` (it must match) and measure what compare mode built for it."""
    kv, seen, copies = worker._kv, {}, []
    copy = RequestState.copy
    monkeypatch.setattr(RequestState, "copy", lambda req: copies.append(req.uuid) or copy(req))
    run = kv.experiment  # the run's hooks, as compare mode handed them to it
    fork, canonicalize = run._fork, run._canonicalize
    run._fork = lambda: seen.setdefault("fork", fork())
    run._canonicalize = lambda *sides: seen.setdefault("forms", canonicalize(*sides))
    before = kv.executor.stats().num_compared.get(op, 0)
    try:
        getattr(kv, {"alloc": "allocate"}.get(op, op))(*args)
    finally:
        run._fork, run._canonicalize = fork, canonicalize
        monkeypatch.undo()
    stats = kv.executor.stats()
    assert stats.num_compared[op] == before + 1
    assert (sum(stats.num_divergences.values()), stats.num_harness_errors) == (0, 0)
    mine, theirs = seen["forms"]
    shares = seen["fork"][0].state.requests is worker.state.requests
    return HarnessWork(len(copies), shares, (len(flatten(mine)), len(flatten(theirs))))


def finish(worker: Worker, num_done: int) -> list[str]:
    """Mark the first ``num_done`` requests FINISHED (what sampling does at a stop token)."""
    done = list(worker.state.requests)[:num_done]
    for uuid in done:
        worker.state.requests[uuid].phase = Phase.FINISHED
    return done


@pytest.mark.parametrize("path", DIRECTIONS.values(), ids=DIRECTIONS.keys())
@pytest.mark.parametrize("op", ["evict", "migrate"])
def test_an_op_that_writes_nothing_copies_nothing_at_any_number_of_requests(
    op, path, tmp_path, monkeypatch
):
    work = [
        harness_work(running_worker(n, path, tmp_path / f"{n}.jsonl"), op, monkeypatch)
        for n in (8, 256)
    ]
    assert work[0] == work[1] == HarnessWork(0, True, (7, 7))  # six counters and the result


@pytest.mark.parametrize("path", DIRECTIONS.values(), ids=DIRECTIONS.keys())
def test_a_release_copies_what_it_released_not_what_is_live(path, tmp_path, monkeypatch):
    work = {}
    for num_requests in (8, 256):
        for num_done in (2, 4):
            worker = running_worker(num_requests, path, tmp_path / f"{num_requests}-{num_done}")
            done = finish(worker, num_done)
            work[num_requests, num_done] = harness_work(worker, "release", monkeypatch, done)
            assert sorted(worker.state.outputs) == sorted(done)
    for num_done in (2, 4):
        assert work[8, num_done] == work[256, num_done]
        # each released request: copied once by the fork, recorded once on the worker
        assert work[8, num_done].requests_copied == 2 * num_done
    assert work[8, 2].form_leaves < work[8, 4].form_leaves  # a pool event per released request


class UntouchableColumn(tuple):
    """A column that fails the test when anything reads an entry of it."""

    def __getitem__(self, index):
        raise AssertionError(f"read entry {index} of a column")

    def __iter__(self):
        raise AssertionError("iterated a column")


def test_classifying_an_evict_or_migrate_that_decided_nothing_reads_no_request():
    geometry = KvGeometry(2, 2, 16, 4, 4, 64, 8, 0.0, 8, 1)
    snapshot = KvSnapshot(3, geometry, num_free_gpu_pages=40, num_free_host_pages=8)
    uuids = UntouchableColumn(f"r{i}" for i in range(500))
    running = PageColumns(uuids, UntouchableColumn(range(500)), UntouchableColumn([()] * 500))
    assert eviction_outcomes(EvictionRequest(snapshot, running, 10), EvictionPlan(())) == [
        "evict.none.above_watermark"
    ]
    nothing_swapped = MigrationRequest(snapshot, SwappedColumns((), (), ()), running, 10, 0)
    assert migration_outcomes(nothing_swapped, MigrationPlan(())) == [
        "migrate.none.nothing_swapped"
    ]
