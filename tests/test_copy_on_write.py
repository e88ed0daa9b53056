"""Compare mode's forks share the worker's requests until they write them.

That holds only if every KV op writes a request through ``WorkerState.edit`` or
``WorkerState.remove``, and drops a pending append through
``KvTarget.drop_pending_append``: a write to a request read any other way, or a
direct change of the request dict or the pending appends, would, on a fork,
change the worker's own state. Both checks below look for such a write: one reads
the source of both paths, one runs every op of both paths on forks of a worker in
a pressure workload and checks the worker is left as it was.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest

from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.loads import observe_loads
from batchgen.engine.runner import run_workload
from batchgen.engine.scheduler import schedule
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import builtin_workload
from batchgen.kv import appliers
from batchgen.kv import legacy as legacy_kv
from batchgen.kv.gate import build_kv_path
from batchgen.model.loader import load_model
from batchgen.shadow.fork import KV_FIELDS, fork_target
from batchgen.shadow.forms import add_requests
from batchgen.state import Phase, Request, RequestState, WorkerStats
from compare import Keyed

WRITE_ENTRIES = ("edit", "remove")


def _request_writes_outside_edit(source: str) -> list[str]:
    """``name.field = ...`` (a request KV field) where ``name`` was not bound from
    ``edit``/``remove``, and direct changes of a request dict or the pending appends."""
    tree = ast.parse(source)
    found = []
    for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        bound = {
            target.id
            for node in ast.walk(func)
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and node.value.func.attr in WRITE_ENTRIES
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(func):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AugAssign)
                else []
            )
            for target in (
                t for tt in targets for t in (tt.elts if isinstance(tt, ast.Tuple) else [tt])
            ):
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr in KV_FIELDS
                    and isinstance(target.value, ast.Name)
                    and target.value.id not in bound
                ):
                    found.append(
                        f"{func.name}:{node.lineno} writes {target.value.id}.{target.attr}"
                    )
            found += [
                f"{func.name}:{node.lineno} changes {ast.unparse(changed)}"
                for changed in _dict_changes(node)
            ]
    return found


def _dict_changes(node: ast.AST) -> list[ast.AST]:
    """A request dict or the pending appends changed directly: item assignment or deletion, pop,
    clear, ..."""
    dicts = ("requests", "pending_appends", "_pending_kv_append_tensors")
    subscripts = [
        t
        for t in (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [])
        if isinstance(t, ast.Subscript)
        and isinstance(t.value, ast.Attribute)
        and t.value.attr in dicts
    ]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr
        in (
            "pop",
            "popitem",
            "clear",
            "update",
            "setdefault",
            "__setitem__",
            "__delitem__",
        )
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr in dicts
    ):
        subscripts.append(node.func)
    return subscripts


OUTPUT_LISTS = ("output_ids", "output_logprobs")
LIST_MUTATORS = (
    "append",
    "extend",
    "insert",
    "pop",
    "remove",
    "clear",
    "sort",
    "reverse",
    "__setitem__",
    "__delitem__",
    "__iadd__",
)


def _output_list_writes(source: str) -> list[str]:
    """In-place changes of a request's output lists. A copy shares them with the request it was
    taken from (``RequestState.copy``), so a fork writing one would write the worker's: KV ops never
    may."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LIST_MUTATORS
        ):
            owner = node.func.value
        elif isinstance(node, (ast.Assign, ast.Delete)):
            owner = next((t.value for t in node.targets if isinstance(t, ast.Subscript)), None)
        elif isinstance(node, ast.AugAssign):
            owner = node.target
        else:
            continue
        if isinstance(owner, ast.Attribute) and owner.attr in OUTPUT_LISTS:
            found.append((node.lineno, f"{node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]


@pytest.mark.parametrize("module", [legacy_kv, appliers], ids=["legacy", "appliers"])
def test_kv_ops_write_requests_only_through_the_write_entries(module):
    assert _request_writes_outside_edit(inspect.getsource(module)) == []
    assert _output_list_writes(inspect.getsource(module)) == []


def test_the_source_check_sees_an_output_list_changed_in_place():
    source = (
        "def release(req):\n    req.output_ids.clear()\n    req.output_logprobs[0] = None\n"
        "    req.output_ids += [1]\n    n = len(req.output_ids)\n"
    )
    assert _output_list_writes(source) == [
        "2: req.output_ids.clear()",
        "3: req.output_logprobs[0] = None",
        "4: req.output_ids += [1]",
    ]


def test_the_source_check_sees_a_write_that_bypasses_the_write_entries():
    source = (
        "def evict(state, uuid):\n    req = state.requests[uuid]\n    req.phase = None\ndef"
        " poll(state, uuid):\n    req = state.edit(uuid)\n    req.phase, req.finish_reason = None,"
        " 'x'\ndef release(target, uuid):\n    target.state.requests.pop(uuid)\n    del"
        " target.pending_appends[uuid]\n"
    )
    assert sorted(_request_writes_outside_edit(source)) == [
        "evict:3 writes req.phase",
        "release:8 changes target.state.requests.pop",
        "release:9 changes target.pending_appends[uuid]",
    ]


def _kv_state(worker: Worker) -> tuple:
    """Every live request's KV fields and output lengths, pending appends, both pools' allocator
    state."""
    pools = tuple(
        (
            pool.free_pages(),
            pool.pages.peek_free_pages(pool.free_pages()),
            {uuid: pool.pages_of(uuid) for uuid in worker.state.requests},
        )
        for pool in (worker.gpu_kv, worker.host_kv)
    )
    requests = {
        uuid: (
            *(getattr(req, name) for name in KV_FIELDS),
            len(req.output_ids),
            len(req.output_logprobs),
        )
        for uuid, req in worker.state.requests.items()
    }
    return requests, tuple(worker._pending_kv_append_tensors), pools


@pytest.mark.parametrize("path", ["legacy", "plan"])
def test_every_op_on_a_fork_leaves_the_worker_as_it_was(path):
    """Before each step of L2-2048 (eviction, migration, recompute, releases, and a third of the
    loads failing: retries and recomputes), each op of ``path`` runs on its own fork; the worker's
    requests, pending appends and pools must not change."""
    workload = builtin_workload("L2-2048")
    worker = Worker(
        load_model("tiny"),
        cache_config=workload.cache,
        engine_config=workload.engine,
        faults=FaultInjector(FaultSpec.parse("seed=3,load_fail=0.3")),
    )
    ops_run = {"poll": 0, "evict": 0, "migrate": 0, "alloc": 0, "release": 0}
    wrote, poll_outcomes = set(), set()

    def on_step(num_released: int, num_requests: int) -> None:
        before = _kv_state(worker)
        # the fault clock the next step's before_step sets: loads land
        worker.faults.step = worker.state.step
        observed = observe_loads(worker.state, worker.engine_config.load_timeout_steps)
        poll_outcomes.update(
            "completed" if error is None else "failed" for error in observed.values()
        )
        done = [
            u for u, r in worker.state.requests.items() if r.phase.name in ("FINISHED", "FAILED")
        ]
        free = worker.gpu_kv.free_pages()
        batch = schedule(worker.state, free, worker.cache_config, worker.engine_config)
        for op, run in (
            ("poll", lambda kv: kv.poll(observed) if observed else None),
            ("release", lambda kv: kv.release(done) if done else None),
            ("evict", lambda kv: kv.evict()),
            ("migrate", lambda kv: kv.migrate()),
            ("alloc", lambda kv: kv.allocate(batch)),
        ):
            fork = fork_target(worker.kv_target())
            run(build_kv_path(path, fork))
            ops_run[op] += 1
            wrote.update(f"{op}:{u}" for u in fork.state.written)
            assert _kv_state(worker) == before, (
                f"{path} {op} on a fork changed the worker at step {worker.state.step}"
            )

    run_workload(worker, workload, on_step=on_step)
    assert all(ops_run.values()), ops_run
    assert {entry.split(":")[0] for entry in wrote} == set(ops_run), (
        "some op never wrote on its fork"
    )
    # polls that retry (a load on the forked host pool) ran
    assert poll_outcomes == {"completed", "failed"}


def test_the_canonical_request_covers_exactly_the_fields_the_change_detection_reads():
    """``differing_requests`` compares KV_FIELDS to pick what to canonicalize; ``add_requests``
    canonicalizes a request: a field in one and not the other would be compared never, or picked and
    never shown."""
    worker = Worker(load_model("tiny"), cache_config=builtin_workload("smoke").cache)
    worker.add_request(builtin_workload("smoke").requests[0].to_request())
    requests, outputs = Keyed(), Keyed()
    add_requests(requests, outputs, worker.kv_target(), list(worker.state.requests))
    [entry] = requests.values()
    renamed = {"load": "load_handle"}  # the handle itself is not comparable: which load it tracks
    assert {renamed.get(key, key) for key in entry} - {"has_pending_append"} == set(KV_FIELDS)


def test_a_request_copy_has_every_field_of_the_original_and_shares_only_the_output_lists():
    request = RequestState(Request("r1", (1, 2, 3), 8, temperature=0.5, seed=7), arrival_index=4)
    values = {
        "phase": Phase.SWAPPED,
        "output_ids": [5, 6],
        "output_logprobs": [],
        "num_cached_tokens": 4,
        "gpu_page_ids": (),
        "host_page_ids": (9, 10),
        "load_handle": None,
        "load_started_step": 11,
        "num_load_retries": 1,
        "swapped_step": 12,
        "finish_reason": None,
        "first_token_step": 9,
        "prompt_digests": ("ab", "cd"),
        "num_cached_prompt_tokens": 16,
        "num_tokens": 5,
    }
    for name, value in values.items():
        setattr(request, name, value)
    copy = request.copy()
    assert copy is not request and copy == request
    assert {f.name for f in dataclasses.fields(RequestState)} == {
        "request",
        "arrival_index",
        "uuid",
        *values,
    }
    assert copy.output_ids is request.output_ids  # shared: KV ops never write them
    copy.phase, copy.gpu_page_ids = Phase.LOADING, (1, 2)
    assert (request.phase, request.gpu_page_ids) == (Phase.SWAPPED, ())


def test_a_counters_copy_has_every_counter_of_the_original_and_is_independent():
    names = [f.name for f in dataclasses.fields(WorkerStats)]
    stats = WorkerStats(*range(1, len(names) + 1))  # each counter its own value
    copy = stats.copy()
    assert copy is not stats and copy == stats
    copy.evictions += 10
    assert stats.evictions == 1
