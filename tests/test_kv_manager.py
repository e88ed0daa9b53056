"""KVCacheManager: the plan layer's pre-merge checklist, exact plans, JSON round trips.

Checklist item -> tests:

- backends by injection, no worker attributes .... test_manager_source_*, test_manager_keeps_only_*
- no live model/cache config (frozen snapshot) .... test_manager_source_imports_*,
                                                   test_eviction_reads_*
- watermark computed from the snapshot ........... test_watermark_*
- pending appends stay on the worker, stateless .. test_manager_source_never_assigns_*,
                                                   test_writing_*,
                                                   test_planning_never_touches_pending_appends
- returns plans, only the worker applies them .... test_manager_never_mutates_its_backends
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import enum
import inspect
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.config import TINY_MODELS, EngineConfig
from batchgen.engine.state import Phase, Request
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import builtin_workload
from batchgen.kv import backends as kv_backends
from batchgen.kv import manager as kv_manager
from batchgen.kv import plans as kv_plans
from batchgen.kv.backends import GpuKvPool, HostKvPool
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.manager import KVCacheManager, eviction_watermark_pages
from batchgen.kv.plans import (
    AllocPlan,
    AllocRequest,
    Destination,
    DoesNotFit,
    EvictionPlan,
    EvictionRequest,
    KvGeometry,
    KvPreState,
    KvSnapshot,
    LoadStart,
    MigrationPlan,
    MigrationRequest,
    PageColumns,
    PageGrant,
    PollAction,
    PollPlan,
    PollRequest,
    ReleasePlan,
    ReleaseRequest,
    RequestKvView,
    SwappedColumns,
    Victim,
    decode_demand,
    from_json,
    to_json,
)
from batchgen.model.null_model import NullModel

RUNNING, SWAPPED, LOADING, WAITING = "running", "swapped", "loading", "waiting"
MANAGER_TREE = ast.parse(Path(inspect.getfile(kv_manager)).read_text(encoding="utf-8"))
READ_ONLY_BACKEND_METHODS = {"peek_free_pages", "free_pages"}


# ---- factories --------------------------------------------------------------------------
def geometry(**changes) -> KvGeometry:
    fields = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        dtype_size=4,
        num_gpu_pages=12,
        num_host_pages=8,
        watermark=0.0,
        max_num_seqs=8,
        max_load_retries=1,
    )
    fields.update(changes)
    return KvGeometry(**fields)


def view(
    uuid: str,
    phase: str,
    arrival_index: int,
    num_tokens: int,
    *,
    gpu=(),
    host=(),
    cached=None,
    retries=0,
    swapped_step=None,
) -> RequestKvView:
    return RequestKvView(
        uuid,
        phase,
        arrival_index,
        num_tokens,
        num_tokens - 1 if cached is None else cached,
        tuple(gpu),
        tuple(host),
        retries,
        swapped_step,
    )


def pools(
    num_gpu: int, num_host: int, *, gpu_owned=None, host_owned=None, gpu_rotate=0, host_rotate=0
):
    """Bookkeeping pools whose free queues are rotated by ``*_rotate`` pages, then owned as
    given."""
    gpu = GpuKvPool(num_gpu)
    host = HostKvPool(num_host, None, gpu)
    for pool, rotate, owned in ((gpu, gpu_rotate, gpu_owned), (host, host_rotate, host_owned)):
        if rotate:
            pool.allocate_pages("rotate", rotate)
            pool.release_pages("rotate")
        for uuid, page_ids in (owned or {}).items():
            pool.take_pages(uuid, list(page_ids))
    return gpu, host


def snapshot_of(geom: KvGeometry, gpu: GpuKvPool, host: HostKvPool, *, step=5) -> KvSnapshot:
    return KvSnapshot(
        step=step,
        geometry=geom,
        num_free_gpu_pages=gpu.free_pages(),
        num_free_host_pages=host.free_pages(),
    )


def page_columns(views) -> PageColumns:
    views = list(views)
    return PageColumns(
        tuple(v.uuid for v in views),
        tuple(v.num_tokens for v in views),
        tuple(v.gpu_page_ids for v in views),
    )


def running_columns(snap: KvSnapshot, views) -> tuple[PageColumns, int]:
    """The RUNNING requests of ``views`` as columns, and their decode demand."""
    running = page_columns(v for v in views if v.phase == RUNNING)
    return running, decode_demand(running.num_tokens, running.gpu_page_ids, snap.geometry.page_size)


def eviction_request(snap: KvSnapshot, views) -> EvictionRequest:
    return EvictionRequest(snap, *running_columns(snap, views))


def migration_request(snap: KvSnapshot, views, num_loading: int) -> MigrationRequest:
    swapped = [v for v in views if v.phase == SWAPPED]
    columns = SwappedColumns(
        tuple(v.uuid for v in swapped),
        tuple(v.host_page_ids for v in swapped),
        tuple(v.swapped_step for v in swapped),
    )
    return MigrationRequest(snap, columns, *running_columns(snap, views), num_loading)


def alloc_request(snap: KvSnapshot, views, batch: tuple[str, ...]) -> AllocRequest:
    by_uuid = {v.uuid: v for v in views}
    needing = [
        by_uuid[u]
        for u in batch
        if by_uuid[u].num_tokens > len(by_uuid[u].gpu_page_ids) * snap.geometry.page_size
    ]
    return AllocRequest(snap, page_columns(needing), batch)


def free_queue(pool) -> list[int]:
    return list(pool.pages._queue[pool.pages._head :])


def pool_dump(pool) -> dict:
    return copy.deepcopy(
        {"pages": vars(pool.pages), "copies": pool.copies if isinstance(pool, HostKvPool) else None}
    )


# Five RUNNING requests on a 12-page GPU pool, page_size 4 (demand = pages for all tokens - pages
# held):
#   a  arrival 0  9 tokens  pages 0,1     demand 1
#   b  arrival 1  9 tokens  pages 2,3     demand 1
#   c  arrival 2  5 tokens  page  4       demand 1
#   d  arrival 3  8 tokens  pages 5,6     demand 0
#   e  arrival 4  13 tokens pages 7,8,9   demand 1
# free 2 (10, 11), total demand 4. With watermark 0.25 (3 pages): e goes
# (free 5 - demand 3 = 2 < 3), then d (free 7 - demand 3 = 4 >= 3): two victims, youngest first.
EVICTION_VIEWS = (
    view("a", RUNNING, 0, 9, gpu=(0, 1)),
    view("b", RUNNING, 1, 9, gpu=(2, 3)),
    view("c", RUNNING, 2, 5, gpu=(4,)),
    view("d", RUNNING, 3, 8, gpu=(5, 6)),
    view("e", RUNNING, 4, 13, gpu=(7, 8, 9)),
)
EVICTION_GPU_OWNED = {v.uuid: v.gpu_page_ids for v in EVICTION_VIEWS}


def eviction_setup(num_host: int, *, host_owned=None, host_rotate=0, watermark=0.25):
    gpu, host = pools(
        12, num_host, gpu_owned=EVICTION_GPU_OWNED, host_owned=host_owned, host_rotate=host_rotate
    )
    snap = snapshot_of(geometry(watermark=watermark, num_host_pages=num_host), gpu, host)
    return KVCacheManager(gpu_kv=gpu, host_kv=host), eviction_request(snap, EVICTION_VIEWS)


# ---- checklist: source rules (AST) ---------------------------------------------------------
def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield node


def _assigned_targets(node: ast.AST):
    if isinstance(node, (ast.Assign, ast.Delete)):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        targets = [node.target]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        targets = [node.optional_vars]
    elif isinstance(node, ast.NamedExpr):
        targets = [node.target]
    else:
        return
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        elif isinstance(target, (ast.Attribute, ast.Subscript)):
            yield target


def self_writes(tree: ast.AST) -> list[str]:
    """Assignments to ``self.<x>`` (or deeper) outside ``__init__``, setattr calls, globals."""
    offences = []
    for func in _functions(tree):
        if getattr(func, "name", None) == "__init__":
            continue
        for node in ast.walk(func):
            for target in _assigned_targets(node):
                base = target.value
                while isinstance(base, (ast.Attribute, ast.Subscript)):
                    base = base.value
                if isinstance(base, ast.Name) and base.id == "self":
                    offences.append(f"line {node.lineno}: {ast.unparse(target)}")
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                if name in ("setattr", "__setattr__", "delattr", "__delattr__"):
                    offences.append(f"line {node.lineno}: {ast.unparse(node)}")
            if isinstance(node, (ast.Global, ast.Nonlocal)):
                offences.append(f"line {node.lineno}: {ast.unparse(node)}")
    return offences


MUTATING_METHODS = (
    "append",
    "extend",
    "pop",
    "clear",
    "update",
    "remove",
    "insert",
    "setdefault",
    "add",
    "discard",
)


def input_writes(tree: ast.AST) -> list[str]:
    """Attribute/item assignments, and mutating calls on anything but a local name, outside
    ``__init__``."""
    offences = []
    for func in _functions(tree):
        if getattr(func, "name", None) == "__init__":
            continue
        for node in ast.walk(func):
            offences += [f"line {node.lineno}: {ast.unparse(t)}" for t in _assigned_targets(node)]
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATING_METHODS
            ):
                receiver = node.func.value
                if not (
                    isinstance(receiver, ast.Name)
                    and receiver.id not in ("self", "req", "snapshot")
                ):
                    offences.append(f"line {node.lineno}: {ast.unparse(node)}")
    return offences


WORKER_ATTRIBUTES = {
    "state",
    "worker",
    "_worker",
    "target",
    "_pending_kv_append_tensors",
    "pending_appends",
    "model_config",
    "cache_config",
    "engine_config",
    "kv_gate",
    "_kv",
    "model",
    "outputs",
    "stats",
    "load_handle",
    "tensor",
    "_watermark_pages",
    "_kv_watermark_pages",
}
FORBIDDEN_NAMES = (
    "worker",
    "target",
    "state",
    "CacheConfig",
    "ModelConfig",
    "EngineConfig",
    "TINY_MODELS",
)


def worker_accesses(tree: ast.AST) -> list[str]:
    """Worker attributes, live configs, and dynamic lookups that could hide either."""
    offences = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in WORKER_ATTRIBUTES:
                offences.append(f"line {node.lineno}: {ast.unparse(node)}")
            elif node.attr == "requests":  # allowed only as a snapshot's scope
                base = node.value
                base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if base_name != "snapshot":
                    offences.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            offences.append(f"line {node.lineno}: {node.id}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "vars", "globals", "__import__", "eval", "exec")
        ):
            offences.append(f"line {node.lineno}: {ast.unparse(node)}")
    return offences


FORBIDDEN_MODULES = (
    "batchgen.engine.state",
    "batchgen.engine.worker",
    "batchgen.kv.legacy",
    "batchgen.kv.target",
    "batchgen.kv.plan_path",
    "batchgen.config",
    "compare",
    "importlib",
)
ALLOWED_BATCHGEN_MODULES = {"batchgen.kv.plans", "batchgen.kv.backends"}


def bad_imports(tree: ast.AST) -> list[str]:
    """Imports of anything in batchgen but the plans and the backend Protocols."""
    from batchgen.kv import backends as kv_backends

    offences = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                offences.append(f"line {node.lineno}: relative import")
            imported = [(node.module or "", alias.name) for alias in node.names]
        else:
            continue
        for module, name in imported:
            if module.startswith(FORBIDDEN_MODULES) or (
                module.startswith("batchgen") and module not in ALLOWED_BATCHGEN_MODULES
            ):
                offences.append(f"line {node.lineno}: {module}")
            elif module == "batchgen.kv.backends" and not getattr(
                getattr(kv_backends, name, None), "_is_protocol", False
            ):
                offences.append(f"line {node.lineno}: {name} is not a Protocol")
    return offences


def test_manager_source_never_assigns_to_self_outside_init():
    assert self_writes(MANAGER_TREE) == []


def test_manager_source_never_writes_to_what_it_is_given():
    assert input_writes(MANAGER_TREE) == []


def test_manager_source_never_reaches_into_worker_attributes_or_live_configs():
    assert worker_accesses(MANAGER_TREE) == []


def test_manager_source_imports_only_plans_and_backend_protocols():
    assert bad_imports(MANAGER_TREE) == []
    imported = {node.module for node in ast.walk(MANAGER_TREE) if isinstance(node, ast.ImportFrom)}
    assert "batchgen.kv.backends" in imported  # the backends are typed with the Protocols


PLANTED = [
    (self_writes, "class M:\n    def plan_x(self, req):\n        self.last = req\n"),
    (self_writes, "class M:\n    def plan_x(self, req):\n        self._cache[req] = 1\n"),
    (self_writes, "class M:\n    def plan_x(self, req):\n        setattr(self, 'n', 1)\n"),
    (input_writes, "def plan_x(req):\n    req.snapshot.requests[0] = None\n"),
    (input_writes, "def plan_x(self, req):\n    self._gpu_kv.pages.journal.append(1)\n"),
    (worker_accesses, "def plan_x(self, req):\n    return self._gpu_kv.worker.state.requests\n"),
    (worker_accesses, "def plan_x(self, req, target):\n    return target.cache_config.watermark\n"),
    (
        worker_accesses,
        "def plan_x(self, req):\n    return self._host_kv._pending_kv_append_tensors\n",
    ),
    (bad_imports, "from batchgen.config import CacheConfig\n"),
    (bad_imports, "from batchgen.engine.state import Phase\n"),
    (bad_imports, "import batchgen.kv.legacy\n"),
    (bad_imports, "from batchgen.kv.backends import GpuKvPool\n"),
]


@pytest.mark.parametrize(("checker", "source"), PLANTED, ids=lambda v: getattr(v, "__name__", None))
def test_source_checks_catch_a_planted_violation(checker, source):
    assert checker(ast.parse(source)) != []


def test_manager_keeps_only_its_injected_backends():
    gpu, host = pools(8, 4)
    manager = KVCacheManager(gpu_kv=gpu, host_kv=host)
    before = dict(vars(manager))
    snap = snapshot_of(geometry(num_gpu_pages=8, num_host_pages=4), gpu, host)
    views = [view("a", RUNNING, 0, 9, gpu=()), view("s", SWAPPED, 1, 4, host=(0,), swapped_step=1)]
    manager.plan_allocation(alloc_request(snap, views, ("a",)))
    manager.plan_eviction(eviction_request(snap, views))
    manager.plan_migration(migration_request(snap, views, 0))
    assert vars(manager) == before
    assert list(before) == ["_gpu_kv", "_host_kv"]
    assert before["_gpu_kv"] is gpu and before["_host_kv"] is host


# ---- checklist: immutability -----------------------------------------------------------------
def _one_of_each():
    snap = KvSnapshot(3, geometry(), 4, 2)
    running = PageColumns(("a",), (5,), ((1, 2),))
    swapped = SwappedColumns(("s",), ((0,),), (2,))
    return [
        snap.geometry,
        snap,
        running,
        swapped,
        view("a", RUNNING, 0, 5, gpu=(1, 2)),
        KvPreState(snap, (view("a", RUNNING, 0, 5, gpu=(1, 2)),)),
        PollRequest(snap, ("a",), ("boom",), (0,)),
        ReleaseRequest(snap, ("a",)),
        EvictionRequest(snap, running, 1),
        MigrationRequest(snap, swapped, running, 1, 1),
        AllocRequest(snap, running, ("a",)),
        PollPlan(("a",), (PollAction.COMPLETE,), (None,)),
        ReleasePlan(("a",), ("a",)),
        Victim("a", Destination.HOST, (1, 2), (0, 1)),
        EvictionPlan(()),
        LoadStart("a", (3,), (4,)),
        MigrationPlan(()),
        PageGrant("a", (5,)),
        DoesNotFit("a", 3, 1),
        AllocPlan((), ()),
    ]


@pytest.mark.parametrize("obj", _one_of_each(), ids=lambda o: type(o).__name__)
def test_writing_to_a_snapshot_view_op_request_or_plan_raises(obj):
    names = obj._fields if isinstance(obj, tuple) else [f.name for f in dataclasses.fields(obj)]
    for name in names:
        with pytest.raises((AttributeError, TypeError)):
            setattr(obj, name, getattr(obj, name))
        with pytest.raises((AttributeError, TypeError)):
            delattr(obj, name)
    with pytest.raises((AttributeError, TypeError)):
        obj.extra_field = 1


def test_a_record_builds_like_its_dataclass_and_copies_pickles_and_replaces():
    @kv_plans.record
    class Point:
        x: int
        label: str = "p"

    point = Point(1)
    assert (point.x, point.label, point, hash(point)) == (
        1,
        "p",
        Point(1, "p"),
        hash(Point(1, "p")),
    )
    assert Point(x=2, label="q") == Point(2, "q") != point
    assert dataclasses.replace(point, label="r") == Point(1, "r")
    assert copy.deepcopy(point) == point and copy.copy(point) == point
    assert repr(point).endswith("Point(x=1, label='p')")
    with pytest.raises(TypeError):
        Point()
    assert (
        Point.new(1) == point
        and Point.new(x=2, label="q") == Point(2, "q")
        and type(Point.new(1)) is Point
    )
    for bad in ((), (1, "p", 3)):
        with pytest.raises(TypeError):
            Point.new(*bad)
    for obj in _one_of_each():  # the module's records pickle and round-trip by value
        assert pickle.loads(pickle.dumps(obj)) == obj


@pytest.mark.parametrize(
    "obj",
    [obj for obj in _one_of_each() if dataclasses.is_dataclass(obj)],
    ids=lambda o: type(o).__name__,
)
def test_new_builds_the_record_the_class_call_builds_and_it_is_as_frozen(obj):
    names = [f.name for f in dataclasses.fields(obj)]
    values = [getattr(obj, name) for name in names]
    built = type(obj).new(*values)
    assert type(built) is type(obj)
    assert (built, hash(built), repr(built)) == (obj, hash(obj), repr(obj))
    assert type(obj).new(**dict(zip(names, values))) == obj
    assert pickle.loads(pickle.dumps(built)) == obj and copy.deepcopy(built) == obj
    for name in names:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(built, name, getattr(built, name))
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(built, name)
    with pytest.raises((AttributeError, TypeError)):
        built.extra_field = 1


@pytest.mark.parametrize(
    "declare",
    [
        lambda: type(
            "Factory",
            (),
            {"__annotations__": {"x": "list"}, "x": dataclasses.field(default_factory=list)},
        ),
        lambda: type(
            "NoInit",
            (),
            {"__annotations__": {"x": "int"}, "x": dataclasses.field(default=0, init=False)},
        ),
        lambda: type(
            "KwOnly", (), {"__annotations__": {"x": "int"}, "x": dataclasses.field(kw_only=True)}
        ),
        lambda: type(
            "PostInit", (), {"__annotations__": {"x": "int"}, "__post_init__": lambda self: None}
        ),
    ],
    ids=["default_factory", "init=False", "kw_only", "__post_init__"],
)
def test_a_record_refuses_what_its_init_would_get_wrong(declare):
    with pytest.raises(TypeError, match=r"need the dataclass's own __init__"):
        kv_plans.record(declare())


@pytest.mark.parametrize(
    "declare",
    [
        lambda: type("FieldNew", (), {"__annotations__": {"new": "int"}}),
        lambda: type("MethodNew", (), {"__annotations__": {"x": "int"}, "new": lambda: None}),
    ],
    ids=["a field", "a method"],
)
def test_a_record_refuses_a_class_with_its_own_new(declare):
    with pytest.raises(TypeError, match=r"has its own 'new'"):
        kv_plans.record(declare())


@pytest.mark.parametrize("name", ["self", "_unfrozen", "_cls"])
def test_a_record_refuses_a_field_named_as_new_s_own_names(name):
    with pytest.raises(TypeError, match=rf"fields \['{name}'\] are names new uses itself"):
        kv_plans.record(type("Clash", (), {"__annotations__": {name: "int"}}))


def test_a_record_refuses_a_base_class():
    @kv_plans.record
    class Base:
        x: int

    with pytest.raises(TypeError, match=r"derives from \['Base'\]"):
        kv_plans.record(type("Derived", (Base,), {"__annotations__": {"y": "int"}}))


def declared(suffix: str) -> set[type]:
    """The classes ``kv_plans`` declares whose names end in ``suffix`` (``Plan``, ``Request``)."""
    return {
        cls
        for cls in vars(kv_plans).values()
        if isinstance(cls, type)
        and cls.__module__ == kv_plans.__name__
        and cls.__name__.endswith(suffix)
    }


def test_the_manager_asks_its_backends_only_what_their_protocols_declare():
    asked = {
        (node.value.attr, node.attr)
        for node in ast.walk(MANAGER_TREE)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr in ("_gpu_kv", "_host_kv")
    }
    assert asked  # the manager does ask (which ids an allocation would get)
    declared = {
        "_gpu_kv": set(vars(kv_backends.GpuKvBackend)),
        "_host_kv": set(vars(kv_backends.HostKvBackend)),
    }
    assert [(backend, method) for backend, method in asked if method not in declared[backend]] == []


def test_every_plan_and_request_class_is_covered_by_the_immutability_test():
    covered = {type(o) for o in _one_of_each()}
    assert declared("Plan") | declared("Request") <= covered
    assert set(kv_plans.OP_REQUEST_TYPES.values()) == declared("Request")


# ---- checklist: watermark from the snapshot ---------------------------------------------------
def test_watermark_is_the_same_for_the_same_snapshot():
    snap = KvSnapshot(0, geometry(num_gpu_pages=100, watermark=0.05), 10, 0)
    assert eviction_watermark_pages(snap) == eviction_watermark_pages(snap) == 5
    assert eviction_watermark_pages(dataclasses.replace(snap, step=9, num_free_gpu_pages=0)) == 5


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"watermark": 0.0}, 0),
        ({"watermark": 0.05}, 5),
        ({"watermark": 0.051}, 6),
        ({"num_gpu_pages": 7, "watermark": 0.25}, 2),
        ({"num_gpu_pages": 200, "watermark": 0.05}, 10),
    ],
)
def test_watermark_follows_the_geometry_of_a_new_snapshot(changes, expected):
    snap = KvSnapshot(0, geometry(**{"num_gpu_pages": 100, **changes}), 0, 0)
    assert eviction_watermark_pages(snap) == expected


def test_eviction_reads_the_watermark_from_the_snapshot_geometry():
    _, request = eviction_setup(8, watermark=0.0)
    manager, strict_request = eviction_setup(8, watermark=0.25)
    assert [v.uuid for v in manager.plan_eviction(request).victims] == ["e"]
    assert [v.uuid for v in manager.plan_eviction(strict_request).victims] == ["e", "d"]


# ---- checklist: backends are only read --------------------------------------------------------
class SpyBackend:
    """Delegates to a pool, records every method called; a mutating call raises."""

    def __init__(self, pool):
        self._pool = pool
        self.calls: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._pool, name)
        if not callable(attr):
            self.calls.append(name)
            return attr

        def spy(*args, **kwargs):
            self.calls.append(name)
            if name not in READ_ONLY_BACKEND_METHODS:
                raise AssertionError(f"the manager called {name}{args} on a backend")
            return attr(*args, **kwargs)

        return spy


class TripwireDict(dict):
    """A dict that records every access while ``armed``."""

    armed = False

    def __init__(self, *args):
        super().__init__(*args)
        self.accesses: list[str] = []

    def _touch(name):  # noqa: N805 (a decorator factory in the class body)
        def method(self, *args, **kwargs):
            if self.armed:
                self.accesses.append(name)
            return getattr(dict, name)(self, *args, **kwargs)

        return method

    for _name in (
        "__getitem__",
        "__setitem__",
        "__delitem__",
        "__contains__",
        "__iter__",
        "__len__",
        "get",
        "pop",
        "popitem",
        "setdefault",
        "update",
        "clear",
        "keys",
        "values",
        "items",
        "copy",
        "__eq__",
        "__or__",
    ):
        locals()[_name] = _touch(_name)
    del _name, _touch


PLAIN_LEAVES = (str, int, float, bool, type(None), enum.Enum)
PLAN_MODULE_TYPES = {
    obj
    for obj in vars(kv_plans).values()
    if isinstance(obj, type) and obj.__module__ == kv_plans.__name__
}


def assert_plain(obj, where="plan") -> None:
    """``obj`` is built only of kv_plans records, tuples and plain values (no lists, dicts, tensors,
    states)."""
    if isinstance(obj, PLAIN_LEAVES):
        return
    assert type(obj) in PLAN_MODULE_TYPES or type(obj) is tuple, (
        f"{where} holds a {type(obj).__name__}"
    )
    if dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            assert_plain(getattr(obj, field.name), f"{where}.{field.name}")
    else:
        for i, item in enumerate(obj):
            assert_plain(item, f"{where}[{i}]")


def assert_round_trips(obj) -> None:
    back = from_json(type(obj), to_json(obj))
    assert back == obj
    # same classes all the way down (a NamedTuple is not a plain tuple)
    assert repr(back) == repr(obj)


@dataclasses.dataclass
class AuditedRun:
    gpu_calls: list[str]
    host_calls: list[str]
    pairs: list[tuple[object, object]]  # (op request, plan) of every plan call
    pending_sizes: list[int]  # pending appends held while planning, per audited plan call
    pending_accesses: list[str]
    stats: object


def _all_requests(path, worker):
    requests = worker.state.requests
    loading = {u: None for u, r in requests.items() if r.phase is Phase.LOADING}
    done = [u for u, r in requests.items() if r.phase in (Phase.FINISHED, Phase.FAILED)]
    batch = [u for u, r in requests.items() if r.phase in (Phase.RUNNING, Phase.WAITING)]
    return [
        ("plan_poll", path.poll_request(loading)),
        ("plan_release", path.release_request(done)),
        ("plan_eviction", path.eviction_request()),
        ("plan_migration", path.migration_request()),
        ("plan_allocation", path.alloc_request(batch)),
    ]


@pytest.fixture(scope="module")
def audited_run() -> AuditedRun:
    """smoke with a small host pool (evicts, migrates, recomputes) on the plan path with spy
    backends, planning every op after every step while the pending appends of the step's forward are
    still held."""
    workload = builtin_workload("smoke").with_cache(num_host_pages=8)
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_gate=KvGateConfig(path="plan"),
        kv_storage=False,
    )
    pending = TripwireDict()
    worker._pending_kv_append_tensors = worker._kv.target.pending_appends = pending
    gpu_spy, host_spy = SpyBackend(worker.gpu_kv), SpyBackend(worker.host_kv)
    manager = KVCacheManager(gpu_kv=gpu_spy, host_kv=host_spy)
    path = worker._kv
    run = AuditedRun(gpu_spy.calls, host_spy.calls, [], [], pending.accesses, worker.state.stats)

    def audited(name):
        def plan(request):
            before = (
                pool_dump(worker.gpu_kv),
                pool_dump(worker.host_kv),
                copy.deepcopy(dict(pending)),
            )
            request_copy = copy.deepcopy(request)
            pending.armed = True
            try:
                result = getattr(manager, name)(request)
            finally:
                pending.armed = False
            assert (
                pool_dump(worker.gpu_kv),
                pool_dump(worker.host_kv),
                dict(pending),
            ) == before, name
            assert request == request_copy, f"{name} changed its request"
            run.pairs.append((request, result))
            return result

        return plan

    path.manager = type(
        "AuditedManager",
        (),
        {
            name: staticmethod(audited(name))
            for name in (
                "plan_poll",
                "plan_release",
                "plan_eviction",
                "plan_migration",
                "plan_allocation",
            )
        },
    )()
    arrivals = sorted(workload.requests, key=lambda r: r.arrival_step)
    while arrivals or worker.has_unfinished():
        while arrivals and arrivals[0].arrival_step <= worker.state.step:
            worker.add_request(arrivals.pop(0).to_request())
        worker.step()
        if pending:
            run.pending_sizes.append(len(pending))
            for name, request in _all_requests(path, worker):
                getattr(path.manager, name)(request)
    return run


def test_manager_never_mutates_its_backends(audited_run):
    stats = audited_run.stats
    # every kind of op was planned
    assert (stats.evictions, stats.loads, stats.recompute_preemptions) == (3, 3, 2)
    assert set(audited_run.gpu_calls) | set(audited_run.host_calls) <= READ_ONLY_BACKEND_METHODS
    assert (
        "peek_free_pages" in audited_run.gpu_calls and "peek_free_pages" in audited_run.host_calls
    )


def test_planning_never_touches_pending_appends(audited_run):
    assert audited_run.pending_sizes and min(audited_run.pending_sizes) > 0
    assert audited_run.pending_accesses == []
    for request, plan in audited_run.pairs:
        assert_plain(request, type(request).__name__)
        assert_plain(plan, type(plan).__name__)


def test_every_request_and_plan_of_a_run_round_trips_through_json(audited_run):
    non_empty = {
        type(plan).__name__
        for _, plan in audited_run.pairs
        if any(getattr(plan, f.name) for f in dataclasses.fields(plan))
    }
    assert non_empty == {"EvictionPlan", "MigrationPlan", "AllocPlan", "ReleasePlan", "PollPlan"}
    # repr is exact for these records
    unique = {repr(obj): obj for pair in audited_run.pairs for obj in pair}
    for obj in unique.values():
        assert_round_trips(obj)
        if hasattr(obj, "snapshot"):
            assert_round_trips(obj.snapshot)


# ---- exact plans: eviction -----------------------------------------------------------------------
def test_eviction_takes_the_youngest_first_and_grants_host_pages_from_the_free_queue_head():
    manager, request = eviction_setup(8, host_rotate=3)  # host free queue 3,4,5,6,7,0,1,2
    assert manager.plan_eviction(request) == EvictionPlan(
        (
            Victim("e", Destination.HOST, (7, 8, 9), (3, 4, 5)),
            Victim("d", Destination.HOST, (5, 6), (6, 7)),
        )
    )


def test_eviction_recomputes_a_victim_the_host_pool_cannot_hold_and_still_stores_a_smaller_one():
    # host: 5 pages, queue rotated to 1,2,3,4,0; a swapped request holds 1,2,3 -> free 4,0
    manager, request = eviction_setup(5, host_rotate=1, host_owned={"s": (1, 2, 3)})
    assert manager.plan_eviction(request) == EvictionPlan(
        (
            Victim("e", Destination.RECOMPUTE, (7, 8, 9), ()),
            Victim("d", Destination.HOST, (5, 6), (4, 0)),
        )
    )


def test_eviction_recomputes_every_victim_when_the_host_pool_is_full():
    manager, request = eviction_setup(2, host_owned={"s": (0, 1)})
    assert manager.plan_eviction(request) == EvictionPlan(
        (
            Victim("e", Destination.RECOMPUTE, (7, 8, 9), ()),
            Victim("d", Destination.RECOMPUTE, (5, 6), ()),
        )
    )


def test_eviction_plans_nothing_above_the_watermark_and_asks_no_backend():
    gpu, host = pools(12, 4, gpu_owned={"a": (0, 1)})
    request = eviction_request(
        snapshot_of(geometry(watermark=0.25), gpu, host), [view("a", RUNNING, 0, 9, gpu=(0, 1))]
    )
    gpu_spy, host_spy = SpyBackend(gpu), SpyBackend(host)
    assert KVCacheManager(gpu_kv=gpu_spy, host_kv=host_spy).plan_eviction(request) == EvictionPlan(
        ()
    )
    assert gpu_spy.calls == host_spy.calls == []


def test_eviction_of_the_only_running_request_moves_all_its_pages_to_the_host_queue_head():
    gpu, host = pools(4, 6, gpu_owned={"a": (0, 1, 2, 3)}, host_owned={"s": (0, 1)})
    snap = snapshot_of(geometry(num_gpu_pages=4, num_host_pages=6), gpu, host)
    plan = KVCacheManager(gpu_kv=gpu, host_kv=host).plan_eviction(
        eviction_request(snap, [view("a", RUNNING, 1, 17, gpu=(0, 1, 2, 3))])
    )
    assert plan == EvictionPlan((Victim("a", Destination.HOST, (0, 1, 2, 3), (2, 3, 4, 5)),))


# ---- exact plans: migration ----------------------------------------------------------------------
# GPU pool of 12: r holds 0,1, a LOADING request (outside the scope) holds 3..7
# -> free queue 2,8,9,10,11.
#   s1  arrival 1  host 0,1    swapped step 3  -> comes back into 2,8       (free 5 -> 3)
#   s2  arrival 2  host 2      swapped step 5  -> skipped: swapped this step
#   s3  arrival 3  host 3,4    swapped step 4  -> comes back into 9,10      (free 3 -> 1)
#   s4  arrival 4  host 5,6    swapped step 4  -> does not fit: migration stops here
#   s5  arrival 5  host 7      swapped step 4  -> would fit, but comes after s4
def migration_setup(*, r_tokens=5, max_num_seqs=8, watermark=0.0):
    gpu, host = pools(12, 8, gpu_owned={"r": (0, 1), "l": (3, 4, 5, 6, 7)})
    views = [
        view("r", RUNNING, 0, r_tokens, gpu=(0, 1)),
        view("s1", SWAPPED, 1, 6, host=(0, 1), swapped_step=3),
        view("s2", SWAPPED, 2, 3, host=(2,), swapped_step=5),
        view("s3", SWAPPED, 3, 8, host=(3, 4), swapped_step=4),
        view("s4", SWAPPED, 4, 7, host=(5, 6), swapped_step=4),
        view("s5", SWAPPED, 5, 2, host=(7,), swapped_step=4),
    ]
    snap = snapshot_of(geometry(max_num_seqs=max_num_seqs, watermark=watermark), gpu, host, step=5)
    assert free_queue(gpu) == [2, 8, 9, 10, 11]
    return KVCacheManager(gpu_kv=gpu, host_kv=host), migration_request(snap, views, num_loading=1)


def test_migration_brings_back_the_oldest_first_skipping_this_steps_swaps_stopping_at_a_misfit():
    manager, request = migration_setup()
    assert manager.plan_migration(request) == MigrationPlan(
        (
            LoadStart("s1", (2, 8), (0, 1)),
            LoadStart("s3", (9, 10), (3, 4)),
        )
    )


def test_migration_leaves_room_for_the_running_requests_decode_demand():
    manager, request = migration_setup(r_tokens=13)  # r needs 2 more pages: free 5 - 2 = 3
    assert manager.plan_migration(request) == MigrationPlan((LoadStart("s1", (2, 8), (0, 1)),))


def test_migration_keeps_the_watermark():
    manager, request = migration_setup(watermark=0.25)  # 3 pages kept free: only s1 (5 - 2 = 3)
    assert manager.plan_migration(request) == MigrationPlan((LoadStart("s1", (2, 8), (0, 1)),))


def test_migration_counts_running_and_loading_requests_against_max_num_seqs():
    manager, request = migration_setup(max_num_seqs=3)  # r + the LOADING one + s1
    assert manager.plan_migration(request) == MigrationPlan((LoadStart("s1", (2, 8), (0, 1)),))
    manager, request = migration_setup(max_num_seqs=2)
    assert manager.plan_migration(request) == MigrationPlan(())


# ---- exact plans: allocation ---------------------------------------------------------------------
# GPU pool of 10, queue rotated by 2, a holds 2,3 and d holds 4,5
# -> free queue 6,7,8,9,0,1 (6 free).
#   a  RUNNING 9 tokens  (2 pages held)  needs 1 -> 6              free 5
#   w  WAITING 21 tokens                 needs 6 -> does not fit   (6 > 5)
#   v  WAITING 4 tokens                  needs 1 -> 7              free 4
#   d  RUNNING 8 tokens  (2 pages held)  needs 0 -> no grant (served as it is)
def test_allocation_grants_exact_page_ids_in_batch_order_and_reports_what_does_not_fit():
    gpu, host = pools(10, 0, gpu_rotate=2, gpu_owned={"a": (2, 3), "d": (4, 5)})
    assert free_queue(gpu) == [6, 7, 8, 9, 0, 1]
    views = [
        view("a", RUNNING, 0, 9, gpu=(2, 3)),
        view("d", RUNNING, 1, 8, gpu=(4, 5)),
        view("w", WAITING, 2, 21, cached=0),
        view("v", WAITING, 3, 4, cached=0),
    ]
    snap = snapshot_of(geometry(num_gpu_pages=10, num_host_pages=0), gpu, host)
    plan = KVCacheManager(gpu_kv=gpu, host_kv=host).plan_allocation(
        alloc_request(snap, views, ("a", "w", "v", "d"))
    )
    assert plan == AllocPlan(
        grants=(PageGrant("a", (6,)), PageGrant("v", (7,))),
        not_fitting=(DoesNotFit("w", num_pages_needed=6, num_pages_free=5),),
    )


def test_allocation_of_an_empty_pool_serves_only_requests_that_need_nothing():
    gpu, host = pools(2, 0, gpu_owned={"a": (0, 1)})
    snap = snapshot_of(geometry(num_gpu_pages=2, num_host_pages=0), gpu, host)
    views = [view("a", RUNNING, 0, 8, gpu=(0, 1)), view("w", WAITING, 1, 1, cached=0)]
    plan = KVCacheManager(gpu_kv=gpu, host_kv=host).plan_allocation(
        alloc_request(snap, views, ("w", "a"))
    )
    assert plan == AllocPlan((), (DoesNotFit("w", 1, 0),))


# ---- exact plans: poll and release ---------------------------------------------------------------
def poll_request(
    outcomes: dict[str, str | None], retries: dict[str, int], **changes
) -> PollRequest:
    snap = KvSnapshot(4, geometry(**changes), 0, 0)
    return PollRequest(
        snap, tuple(outcomes), tuple(outcomes.values()), tuple(retries[u] for u in outcomes)
    )


def test_poll_completes_every_load_when_all_landed_without_reading_retries():
    snap = KvSnapshot(4, geometry(), 0, 0)
    gpu, host = pools(8, 4)
    plan = KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(
        PollRequest(snap, ("l2", "l1"), (None, None), ())
    )
    assert plan == PollPlan(("l2", "l1"), (PollAction.COMPLETE,) * 2, (None, None))


def test_poll_completes_landed_loads_retries_failed_ones_then_recomputes_in_observed_order():
    request = poll_request(
        {"l2": "OSError: x", "l1": None, "l3": "OSError: y"}, {"l1": 0, "l2": 1, "l3": 0}
    )
    gpu, host = pools(8, 4)
    assert KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(request) == PollPlan(
        ("l2", "l1", "l3"),
        (PollAction.RECOMPUTE, PollAction.COMPLETE, PollAction.RETRY),
        (None, None, None),
    )


def test_a_poll_request_whose_retries_do_not_match_its_failed_loads_is_refused():
    request = poll_request({"l1": "OSError: x", "l2": None}, {"l1": 0, "l2": 0})
    gpu, host = pools(8, 4)
    with pytest.raises(ValueError, match="zip"):
        KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(
            dataclasses.replace(request, num_load_retries=(0,))
        )


def test_poll_recomputes_at_once_when_no_retries_are_allowed():
    request = poll_request({"l1": "OSError: x"}, {"l1": 0}, max_load_retries=0)
    gpu, host = pools(8, 4)
    assert KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(request) == PollPlan(
        ("l1",), (PollAction.RECOMPUTE,), (None,)
    )


def test_poll_fails_the_request_with_the_load_error_when_the_policy_says_fail():
    request = poll_request(
        {"l1": "OSError: x", "l2": "OSError: y"}, {"l1": 1, "l2": 0}, load_failure="fail"
    )
    gpu, host = pools(8, 4)
    assert KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(request) == PollPlan(
        ("l1", "l2"), (PollAction.FAIL, PollAction.RETRY), ("load failed: OSError: x", None)
    )


def test_release_releases_and_drops_the_pending_appends_of_exactly_the_done_requests():
    gpu, host = pools(4, 4)
    snap = KvSnapshot(2, geometry(), 4, 4)
    plan = KVCacheManager(gpu_kv=gpu, host_kv=host).plan_release(ReleaseRequest(snap, ("f", "x")))
    assert plan == ReleasePlan(released=("f", "x"), drop_pending_append_ids=("f", "x"))


# ---- JSON round trips (hypothesis) ---------------------------------------------------------------
uuids = st.text(min_size=1, max_size=12)
page_ids = st.lists(st.integers(0, 10**6), max_size=6).map(tuple)
counts = st.integers(0, 10**9)
geometries = st.builds(
    KvGeometry,
    num_layers=st.integers(1, 128),
    num_kv_heads=st.integers(1, 64),
    head_dim=st.integers(1, 256),
    page_size=st.integers(1, 256),
    dtype_size=st.sampled_from([2, 4]),
    num_gpu_pages=counts,
    num_host_pages=counts,
    watermark=st.floats(0.0, 0.999, allow_nan=False),
    max_num_seqs=st.integers(1, 10**5),
    max_load_retries=st.integers(0, 10),
    load_failure=st.sampled_from(["recompute", "fail"]),
)
views = st.builds(
    RequestKvView,
    uuid=uuids,
    phase=st.sampled_from([p.value for p in Phase]),
    arrival_index=counts,
    num_tokens=counts,
    num_cached_tokens=counts,
    gpu_page_ids=page_ids,
    host_page_ids=page_ids,
    num_load_retries=st.integers(0, 10),
    swapped_step=st.none() | counts,
)
snapshots = st.builds(
    KvSnapshot,
    step=counts,
    geometry=geometries,
    num_free_gpu_pages=counts,
    num_free_host_pages=counts,
)
uuid_tuples = st.lists(uuids, max_size=4).map(tuple)
columns = st.lists(st.tuples(uuids, counts, page_ids), max_size=4).map(
    lambda rows: (
        PageColumns(*(tuple(column) for column in zip(*rows))) if rows else PageColumns((), (), ())
    )
)
swapped_columns = st.lists(st.tuples(uuids, page_ids, counts), max_size=4).map(
    lambda rows: (
        SwappedColumns(*(tuple(column) for column in zip(*rows)))
        if rows
        else SwappedColumns((), (), ())
    )
)
outcomes = st.lists(st.tuples(uuids, st.none() | st.text(), st.integers(0, 10)), max_size=3)
op_requests = st.one_of(
    st.builds(
        lambda snap, rows: (
            PollRequest(snap, *(tuple(column) for column in zip(*rows)))
            if rows
            else PollRequest(snap, (), (), ())
        ),
        snapshots,
        outcomes,
    ),
    st.builds(ReleaseRequest, snapshots, uuid_tuples),
    st.builds(EvictionRequest, snapshots, columns, counts),
    st.builds(MigrationRequest, snapshots, swapped_columns, columns, counts, counts),
    st.builds(AllocRequest, snapshots, columns, uuid_tuples),
    st.builds(KvPreState, snapshots, st.lists(views, max_size=4).map(tuple)),
)
plans = st.one_of(
    st.lists(st.tuples(uuids, st.sampled_from(PollAction), st.none() | st.text()), max_size=4).map(
        lambda rows: (
            PollPlan(*(tuple(column) for column in zip(*rows))) if rows else PollPlan((), (), ())
        )
    ),
    st.builds(ReleasePlan, uuid_tuples, uuid_tuples),
    st.builds(
        EvictionPlan,
        st.lists(
            st.builds(Victim, uuids, st.sampled_from(Destination), page_ids, page_ids), max_size=4
        ).map(tuple),
    ),
    st.builds(
        MigrationPlan,
        st.lists(st.builds(LoadStart, uuids, page_ids, page_ids), max_size=4).map(tuple),
    ),
    st.builds(
        AllocPlan,
        st.lists(st.builds(PageGrant, uuids, page_ids), max_size=4).map(tuple),
        st.lists(st.builds(DoesNotFit, uuids, counts, counts), max_size=3).map(tuple),
    ),
)


@settings(max_examples=50, deadline=None)
@given(snapshots)
def test_any_snapshot_round_trips_through_json_exactly(snapshot):
    assert_round_trips(snapshot)


@settings(max_examples=50, deadline=None)
@given(op_requests)
def test_any_op_request_round_trips_through_json_exactly(request):
    assert_round_trips(request)


@settings(max_examples=50, deadline=None)
@given(plans)
def test_any_plan_round_trips_through_json_exactly(plan):
    assert_round_trips(plan)


def test_round_trips_cover_every_plan_and_request_type():
    assert {
        type(plan)
        for plan in (
            PollPlan((), (), ()),
            ReleasePlan((), ()),
            EvictionPlan(()),
            MigrationPlan(()),
            AllocPlan((), ()),
        )
    } == declared("Plan")
    for obj in _one_of_each():
        assert_round_trips(obj)


def test_engine_config_is_not_what_the_manager_reads():
    """A snapshot whose geometry disagrees with any engine config still decides by the snapshot."""
    request = poll_request({"l1": "OSError: x"}, {"l1": 0}, max_load_retries=3)
    assert EngineConfig().max_load_retries != 3
    gpu, host = pools(8, 4)
    assert KVCacheManager(gpu_kv=gpu, host_kv=host).plan_poll(request).actions == (
        PollAction.RETRY,
    )


def test_a_request_added_to_the_worker_after_the_snapshot_does_not_change_the_plan():
    workload = builtin_workload("smoke")
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_storage=False,
    )
    for req in workload.requests[:3]:
        worker.add_request(req.to_request())
    worker.step()
    request = worker._kv.alloc_request(list(worker.state.requests))
    plan = worker._kv.manager.plan_allocation(request)
    worker.add_request(Request("late", (1, 2, 3), 4))
    assert worker._kv.manager.plan_allocation(request) == plan
