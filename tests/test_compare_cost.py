"""Compare mode's own work grows with what an op wrote, not with the live requests.

The harness (fork, journals, change detection, canonical forms, comparison) is
measured in bytecodes executed outside the two paths' op calls: evict and
migrate read every running request on either path, which is the paths' cost,
not the harness's. A bytecode count is deterministic, so these tests compare
exact counts: equal for the same op at 8 and 256 live requests, larger when the
op writes more requests. (What a count cannot see: C-level work inside one call;
the one such cost that grows with the live requests is the fork's shallow copy of
the request dict on its first write, a few ns per request.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.model.null_model import NullModel
from batchgen.worker.kv_apply import PlanKvPath
from batchgen.worker.kv_gate import KvGateConfig
from batchgen.worker.legacy_kv import LegacyKvPath
from batchgen.worker.state import Phase, Request
from batchgen.worker.worker import Worker

PATH_OPS = {getattr(cls, op).__code__ for cls in (PlanKvPath, LegacyKvPath)
            for op in ("poll", "release", "evict", "migrate", "allocate")}
DIRECTIONS = {"plan authoritative": "plan", "legacy authoritative": "legacy"}


def running_worker(num_requests: int, path: str, log) -> Worker:
    """A bookkeeping-only worker in compare mode ("raise") with ``num_requests`` RUNNING requests of 20 tokens
    (two pages each: the next decode steps need no new page) and room for all of them."""
    worker = Worker(NullModel(TINY_MODELS["tiny"]),
                    cache_config=CacheConfig(num_gpu_pages=4 * num_requests + 64, num_host_pages=64),
                    engine_config=EngineConfig(max_num_seqs=num_requests, max_num_batched_tokens=64 * num_requests),
                    kv_gate=KvGateConfig(path=path, compare="raise", compare_log=str(log)), kv_storage=False)
    for i in range(num_requests):
        worker.add_request(Request(uuid=f"r{i}", prompt_ids=tuple(range(1, 21)), max_new_tokens=100))
    worker.step()  # admits and prefills all of them
    assert [r.phase for r in worker.state.requests.values()] == [Phase.RUNNING] * num_requests
    return worker


def compared_bytecodes(worker: Worker, name: str, op: Callable[[], object]) -> int:
    """``harness_bytecodes(op)``, checking that ``op`` is one compared op ``name`` that matched."""
    before = worker._kv.executor.stats()
    count = harness_bytecodes(op)
    after = worker._kv.executor.stats()
    assert after.num_compared[name] == before.num_compared.get(name, 0) + 1
    assert (sum(after.num_divergences.values()), after.num_harness_errors) == (0, 0)
    return count


def harness_bytecodes(op: Callable[[], object]) -> int:
    """Bytecodes ``op`` executes outside the KV paths' own op calls (both sides, any depth below them)."""
    count = 0
    inside_path = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
        return local

    def leave_path(frame, event, arg):
        nonlocal inside_path
        if event == "return":
            inside_path -= 1
        return leave_path

    def on_call(frame, event, arg):
        nonlocal inside_path
        if inside_path:
            return None
        if frame.f_code in PATH_OPS:
            inside_path += 1
            return leave_path
        frame.f_trace_opcodes = True
        return local

    sys.settrace(on_call)
    try:
        op()
    finally:
        sys.settrace(None)
    return count


def finish(worker: Worker, num_done: int) -> list[str]:
    """Mark the first ``num_done`` requests FINISHED (what sampling does on a stop token); their uuids."""
    done = list(worker.state.requests)[:num_done]
    for uuid in done:
        worker.state.requests[uuid].phase = Phase.FINISHED
    return done


@pytest.mark.parametrize("path", DIRECTIONS.values(), ids=DIRECTIONS.keys())
@pytest.mark.parametrize("op", ["evict", "migrate"])
def test_an_op_that_writes_nothing_costs_the_harness_the_same_at_any_number_of_requests(op, path, tmp_path):
    counts = []
    for num_requests in (8, 256):
        worker = running_worker(num_requests, path, tmp_path / f"{num_requests}.jsonl")
        counts.append(compared_bytecodes(worker, op, getattr(worker._kv, op)))
    assert counts[0] == counts[1] > 0


@pytest.mark.parametrize("path", DIRECTIONS.values(), ids=DIRECTIONS.keys())
def test_a_release_costs_the_harness_what_it_released_not_what_is_live(path, tmp_path):
    counts = {}
    for num_requests in (8, 256):
        for num_done in (2, 4):
            worker = running_worker(num_requests, path, tmp_path / f"{num_requests}-{num_done}.jsonl")
            done = finish(worker, num_done)
            counts[num_requests, num_done] = compared_bytecodes(worker, "release", lambda: worker._kv.release(done))
            assert sorted(worker.state.outputs) == sorted(done)
    assert counts[8, 2] == counts[256, 2] < counts[8, 4] == counts[256, 4]


def test_the_count_sees_harness_work_that_grows_with_the_live_requests(tmp_path, monkeypatch):
    """The measure itself: a harness that scans every live request per op is counted as growing."""
    from batchgen.worker import kv_compare

    quiet_form = kv_compare._quiet_form

    def scanning_quiet_form(target, result):
        assert all(r.phase is not None for r in target.state.requests.values())
        return quiet_form(target, result)

    monkeypatch.setattr(kv_compare, "_quiet_form", scanning_quiet_form)
    counts = [harness_bytecodes(running_worker(n, "plan", tmp_path / f"{n}.jsonl")._kv.evict) for n in (8, 256)]
    assert counts[1] - counts[0] >= 2 * (256 - 8)  # a generator step per request, on both sides
