"""Replay one logged KV divergence offline, from its record alone.

``replay_record`` rebuilds the op's pre-state twice (``rebuild``), runs the authoritative path on
one and the shadow path on a fork of the other (as compare mode does), compares their canonical
forms, and says whether the logged divergence came back. Nothing outside the record is read: a
demo bug the record's run planted in its shadow path is planted in the replayed shadow too.
The rebuilt target is checked first: the op request the plan path builds from it must equal the
recorded one, or ``ReplayError`` names the differing fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchgen.kv.gate import build_kv_path
from batchgen.kv.known_bugs import DEMO_BUGS, KnownBug, demo_bug
from batchgen.kv.plan_path import OP_METHODS, PlanKvPath
from batchgen.kv.plans import to_jsonable
from batchgen.kv.target import KvTarget
from batchgen.shadow.fork import fork_target, op_scope
from batchgen.shadow.forms import canonical_kv, classify, exception_kind
from batchgen.shadow.recording import recorded, start
from batchgen.triage.rebuild import ReplayError, kv_paths, op_request, rebuild_target
from compare import DivergenceRecord, Observation, compare_observations, diff


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    """What replaying a record's op gave, and whether it matches the logged divergence."""

    reproduced: bool  # same kind and same field paths as the record (exceptions: same kind)
    kind: str | None  # the replayed divergence's kind; None when the two paths agreed
    field_paths: tuple[str, ...]  # flattened paths that differ (sorted); () when a side raised
    diff: dict  # JSON-safe explanation of field_paths; {} when they agree or a side raised
    exceptions: tuple[str, ...]  # "<path> raised <Type>: <message>" per side that raised


def replay_record(record: DivergenceRecord) -> ReplayOutcome:
    """Run both paths through the record's op, each on its own rebuilt pre-state, and compare as
    ``compare.ShadowExecutor`` does. Pure function of the record: the targets it mutates are its
    own. ReplayError for a data divergence: its record holds no page bytes to replay."""
    if record.kind == "data":
        raise ReplayError(
            f"record {record.op} step {record.step} is a data divergence (page bytes), which"
            " cannot be replayed from a record: forks copy no tensors; rerun its workload with"
            " `batchgen minimize LOG --index N`"
        )
    request = op_request(record)
    op, args = record.replay["op"], op_arguments(record.replay["op"], request)
    authoritative_target, shadow_target = rebuild_target(record), rebuild_target(record)
    build = getattr(PlanKvPath(authoritative_target), OP_METHODS[op][1])
    _check_request(record, request, build(*args))
    kv_path, shadow_path = kv_paths(record.replay)
    run = (op, args, request)
    bug = demo_bug(recorded_demo_bug(record), shadow_path)
    authoritative = _observe(kv_path, lambda: _run(authoritative_target, kv_path, *run))
    shadow = _observe(
        shadow_path, lambda: _run(shadow_target, shadow_path, *run, on_fork=True, bug=bug)
    )
    comparison = compare_observations(
        op, record.step, authoritative, shadow, classify=classify, exception_kind=exception_kind
    )
    paths = comparison.field_paths
    reproduced = comparison.kind == record.kind and paths == tuple(record.field_paths)
    detail = comparison.diff.detail if comparison.diff is not None else {}
    return ReplayOutcome(reproduced, comparison.kind, paths, detail, comparison.exceptions)


def recorded_demo_bug(record: DivergenceRecord) -> str | None:
    """The demo bug the record's run planted in its shadow path (None: none); ReplayError for a
    name this version does not know. Pure."""
    name = record.replay.get("demo_bug")
    if name is not None and name not in DEMO_BUGS:
        raise ReplayError(
            f"the record's demo_bug must be one of {', '.join(DEMO_BUGS)}, not {name!r}"
        )
    return name


def op_arguments(op: str, request) -> tuple:
    """The arguments the worker passed ``op``, from its recorded op request. Pure."""
    if op == "poll":
        return (dict(zip(request.uuids, request.errors)),)
    if op == "release":
        return (list(request.uuids),)
    if op == "alloc":
        return (list(request.batch),)
    return ()


def _run(
    target: KvTarget,
    path: str,
    op: str,
    args: tuple,
    request,
    *,
    on_fork: bool = False,
    bug: KnownBug | None = None,
) -> dict:
    """``op`` on ``target`` itself, what it writes recorded, or on a fork of it, ``bug`` planted in
    the path; its canonical form over the op's scope. Mutates ``target`` (not on a fork)."""
    scope = op_scope(op, request, target.state.requests)
    if on_fork:
        on = fork_target(target)
    else:  # the requests before the op wrote them: canonical forms name load handles
        on = recorded(target)
        start(on)
    kv_path = build_kv_path(path, on)
    if bug is not None:
        bug.plant(kv_path)
    result = getattr(kv_path, OP_METHODS[op][0])(*args)
    gpu, host = on.gpu_kv, on.host_kv
    return canonical_kv(on, scope, result, gpu.journal, host.journal, host.copies)


def _observe(path: str, run: Callable[[], dict]) -> Observation:
    try:
        return Observation(path, run())
    except Exception as error:
        return Observation(path, None, error)


def _check_request(record: DivergenceRecord, recorded, rebuilt) -> None:
    """ReplayError unless the rebuilt pre-state yields the recorded op request."""
    if rebuilt != recorded:
        paths = diff(to_jsonable(recorded), to_jsonable(rebuilt)).paths
        raise ReplayError(
            f"{record.op} step {record.step}: the rebuilt pre-state gives a different op request "
            f"at {', '.join(paths[:10])}"
        )
