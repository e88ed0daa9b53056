"""Compare mode's own work grows with what an op wrote, not with the live requests.

The harness (fork, journals, change detection, canonical forms, comparison) is
measured outside the two paths' op calls: evict and migrate read every running
request on either path, which is the paths' cost, not the harness's. Two
deterministic measures, compared exactly between 8 and 256 live requests: the
bytecodes the harness executes (Python-level work), and the leaves of the two
canonical forms it builds and compares (work done in C, such as copying or
comparing containers, shows there). Also checked: on an op that writes nothing,
the fork never copies the worker's request dict. (Not measured: the fork's
shallow copy of that dict on its first write, C-level, a few ns per live request.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.engine.state import Phase, Request
from batchgen.engine.worker import Worker
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.legacy import LegacyKvPath
from batchgen.kv.plan_path import PlanKvPath
from batchgen.model.null_model import NullModel
from batchgen.shadow.kv_compare import KvCompare
from compare.canonical import flatten

PATH_OPS = {
    getattr(cls, op).__code__
    for cls in (PlanKvPath, LegacyKvPath)
    for op in ("poll", "release", "evict", "migrate", "allocate")
}
DIRECTIONS = {"plan authoritative": "plan", "legacy authoritative": "legacy"}


def running_worker(num_requests: int, path: str, log) -> Worker:
    """A bookkeeping-only worker in compare mode ("raise") with ``num_requests`` RUNNING requests of
    20 tokens (two pages each: the next decode steps need no new page) and room for all of them."""
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=CacheConfig(num_gpu_pages=4 * num_requests + 64, num_host_pages=64),
        engine_config=EngineConfig(
            max_num_seqs=num_requests, max_num_batched_tokens=64 * num_requests
        ),
        kv_gate=KvGateConfig(path=path, compare="raise", compare_log=str(log)),
        kv_storage=False,
    )
    for i in range(num_requests):
        worker.add_request(
            Request(uuid=f"r{i}", prompt_ids=tuple(range(1, 21)), max_new_tokens=100)
        )
    worker.step()  # admits and prefills all of them
    assert [r.phase for r in worker.state.requests.values()] == [Phase.RUNNING] * num_requests
    return worker


@dataclass
class HarnessWork:
    """What compare mode did for one op, outside the two paths' op calls."""

    bytecodes: int  # Python-level work (deterministic)
    # leaves of the two canonical forms compared (what was built in C, too)
    form_leaves: tuple[int, int]
    # the fork still reads the worker's request dict (it wrote no request)
    fork_shares_requests: bool


def harness_work(worker: Worker, name: str, op: Callable[[], object]) -> HarnessWork:
    """Run ``op``, one compared op ``name`` that must match, and measure the harness's work in
    it."""
    kv, seen = worker._kv, {}

    def fork():
        seen["fork"] = forked = KvCompare._fork(kv)
        return forked

    def canonicalize(authoritative, shadow):
        seen["forms"] = forms = KvCompare._canonicalize(kv, authoritative, shadow)
        return forms

    # instance attributes: KvCompare hands these to the executor
    kv._fork, kv._canonicalize = fork, canonicalize
    before = kv.executor.stats()
    try:
        count = harness_bytecodes(op)
    finally:
        del kv._fork, kv._canonicalize
    after = kv.executor.stats()
    assert after.num_compared[name] == before.num_compared.get(name, 0) + 1
    assert (sum(after.num_divergences.values()), after.num_harness_errors) == (0, 0)
    mine, theirs = seen["forms"]
    fork_state = seen["fork"][0].state
    return HarnessWork(
        count,
        (len(flatten(mine)), len(flatten(theirs))),
        fork_state.requests is worker.state.requests,
    )


def harness_bytecodes(op: Callable[[], object]) -> int:
    """Bytecodes ``op`` executes outside the KV paths' own op calls (both sides, any depth below
    them)."""
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

    previous = sys.gettrace()  # a coverage tool's or debugger's tracer, put back after
    sys.settrace(on_call)
    try:
        op()
    finally:
        sys.settrace(previous)
    return count


def finish(worker: Worker, num_done: int) -> list[str]:
    """Mark the first ``num_done`` requests FINISHED (what sampling does on a stop token); their
    uuids."""
    done = list(worker.state.requests)[:num_done]
    for uuid in done:
        worker.state.requests[uuid].phase = Phase.FINISHED
    return done


@pytest.mark.parametrize("path", DIRECTIONS.values(), ids=DIRECTIONS.keys())
@pytest.mark.parametrize("op", ["evict", "migrate"])
def test_an_op_that_writes_nothing_costs_the_harness_the_same_at_any_number_of_requests(
    op, path, tmp_path
):
    work = [
        harness_work(worker, op, getattr(worker._kv, op))
        for worker in (running_worker(n, path, tmp_path / f"{n}.jsonl") for n in (8, 256))
    ]
    assert work[0] == work[1]
    assert work[0].bytecodes > 0 and work[0].fork_shares_requests
    assert work[0].form_leaves == (5, 5)  # four counters and the result, on each side


@pytest.mark.parametrize("path", DIRECTIONS.values(), ids=DIRECTIONS.keys())
def test_a_release_costs_the_harness_what_it_released_not_what_is_live(path, tmp_path):
    work = {}
    for num_requests in (8, 256):
        for num_done in (2, 4):
            worker = running_worker(
                num_requests, path, tmp_path / f"{num_requests}-{num_done}.jsonl"
            )
            done = finish(worker, num_done)
            work[num_requests, num_done] = harness_work(
                worker, "release", lambda w=worker, d=done: w._kv.release(d)
            )
            assert sorted(worker.state.outputs) == sorted(done)
    for num_done in (2, 4):
        assert work[8, num_done].bytecodes == work[256, num_done].bytecodes
        assert work[8, num_done].form_leaves == work[256, num_done].form_leaves
    assert work[8, 2].bytecodes < work[8, 4].bytecodes
    # one pool event (and its pages) per released request
    assert work[8, 2].form_leaves < work[8, 4].form_leaves


def _scanning(quiet_form):
    def form(target, result):  # a Python-level scan of every live request per op
        assert all(r.phase is not None for r in target.state.requests.values())
        return quiet_form(target, result)

    return form


def _copying(quiet_form):
    def form(target, result):  # C-level: every live request copied into the form
        return {**quiet_form(target, result), "requests": dict(target.state.requests)}

    return form


@pytest.mark.parametrize(
    "bug, grows",
    [(_scanning, "bytecodes"), (_copying, "form_leaves")],
    ids=["python scan", "C copy"],
)
def test_the_measure_sees_harness_work_that_grows_with_the_live_requests(
    bug, grows, tmp_path, monkeypatch
):
    from batchgen.shadow import kv_compare

    monkeypatch.setattr(kv_compare, "_quiet_form", bug(kv_compare._quiet_form))
    small, large = (
        harness_work(worker, "evict", worker._kv.evict)
        for worker in (running_worker(n, "plan", tmp_path / f"{n}.jsonl") for n in (8, 256))
    )
    assert getattr(large, grows) > getattr(small, grows)
