"""The plan layer's records: frozen, made of plain values, round-tripping through JSON exactly."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgen.kv import plans as kv_plans
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
    from_json,
    to_json,
)
from batchgen.state import Phase


def geometry(**changes) -> KvGeometry:
    fields = dict(
        num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype_size=4, num_gpu_pages=12,
        num_host_pages=8, watermark=0.0, max_num_seqs=8, max_load_retries=1,
    )  # fmt: skip
    fields.update(changes)
    return KvGeometry(**fields)


def view(uuid: str, phase: str, arrival_index: int, num_tokens: int, *, gpu=()) -> RequestKvView:
    return RequestKvView(
        uuid, phase, arrival_index, num_tokens, num_tokens - 1, gpu, (), 0, None, 1
    )


def assert_round_trips(obj) -> None:
    back = from_json(type(obj), to_json(obj))
    assert back == obj
    assert repr(back) == repr(obj)  # same classes all the way down (a NamedTuple is no tuple)


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
        view("a", "running", 0, 5, gpu=(1, 2)),
        KvPreState(snap, (view("a", "running", 0, 5, gpu=(1, 2)),)),
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


def declared(suffix: str) -> set[type]:
    """The classes ``kv_plans`` declares whose names end in ``suffix`` (``Plan``, ``Request``)."""
    return {
        cls
        for cls in vars(kv_plans).values()
        if isinstance(cls, type)
        and cls.__module__ == kv_plans.__name__
        and cls.__name__.endswith(suffix)
    }


def test_every_plan_and_request_class_is_covered_by_the_immutability_test():
    covered = {type(o) for o in _one_of_each()}
    assert declared("Plan") | declared("Request") <= covered
    assert set(kv_plans.OP_REQUEST_TYPES.values()) == declared("Request")


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
    num_prompt_tokens=counts,
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
