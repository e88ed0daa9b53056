"""Workloads: seeded built-in traces, and workload files that load or fail with a named problem."""

import re

import pytest

from batchgen.config import TINY_MODELS, pages_needed
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import (
    BUILTIN_WORKLOADS,
    WorkloadError,
    builtin_workload,
    load_workload,
)
from batchgen.model.null_model import NullModel


@pytest.mark.parametrize("name", BUILTIN_WORKLOADS)
def test_builtin_trace_is_the_same_for_the_same_seed_and_differs_for_another(name):
    assert builtin_workload(name, seed=3) == builtin_workload(name, seed=3)
    assert builtin_workload(name, seed=3).requests != builtin_workload(name, seed=4).requests
    assert load_workload(name, seed=3) == builtin_workload(name, seed=3)


@pytest.mark.parametrize("name, context", [("L2-2048", 2048), ("L2-4096", 4096)])
def test_l2_trace_reaches_its_context_and_outgrows_its_gpu_pool(name, context):
    workload = builtin_workload(name)
    assert len(workload.requests) == 32
    assert workload.max_context == context
    demand = sum(
        pages_needed(len(r.prompt_ids) + r.max_new_tokens, workload.cache.page_size)
        for r in workload.requests
    )
    assert pages_needed(context, workload.cache.page_size) < workload.cache.num_gpu_pages < demand


def test_scale_grows_the_request_count_and_the_pools_above_one():
    small, large = builtin_workload("L2-2048", scale=0.25), builtin_workload("L2-2048", scale=2.0)
    assert (len(small.requests), len(large.requests)) == (8, 64)
    assert small.cache == builtin_workload("L2-2048").cache
    assert large.cache.num_gpu_pages == 2 * builtin_workload("L2-2048").cache.num_gpu_pages


@pytest.mark.parametrize("name", ["L2-2048", "L2-4096"])
@pytest.mark.parametrize("scale", [1, 2, 4, 8])
def test_the_l2_traces_keep_evicting_to_host_as_they_scale(name, scale):
    workload = builtin_workload(name, scale=scale)
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_storage=False,
    )
    stats = run_workload(worker, workload).stats
    assert stats.evictions >= 10 and stats.loads == stats.evictions


def test_token_ids_stay_inside_the_vocabulary():
    workload = builtin_workload("smoke", vocab_size=7)
    assert all(0 < token < 7 for r in workload.requests for token in r.prompt_ids)


def test_unknown_workload_name_lists_the_builtin_ones():
    with pytest.raises(
        WorkloadError,
        match=r"^unknown workload 'L2-1024'; built-in workloads are smoke, L2-2048, "
        r"L2-4096, shared-prefix, or give the path of a workload JSON file$",
    ):
        load_workload("L2-1024")


@pytest.mark.parametrize("scale", [0, -1, 1e9])
def test_a_scale_outside_its_range_is_rejected_before_any_request_is_built(scale):
    with pytest.raises(
        WorkloadError, match=rf"^scale must be a number in \(0, 1000\], got {scale!r}$"
    ):
        builtin_workload("smoke", scale=scale)


def test_workload_json_round_trips(tmp_path):
    workload = builtin_workload("smoke", seed=5)
    path = tmp_path / "smoke.json"
    path.write_text(workload.model_dump_json())
    assert load_workload(str(path)) == workload


def test_a_workload_file_with_a_byte_order_mark_reads_as_without_one(tmp_path):
    workload = builtin_workload("smoke", seed=5)
    path = tmp_path / "smoke.json"
    # what some editors save
    path.write_bytes(b"\xef\xbb\xbf" + workload.model_dump_json().encode())
    assert load_workload(str(path)) == workload


REQUEST = '{"uuid": "a", "prompt_ids": [1, 2], "max_new_tokens": 3}'
CACHE = '{"num_gpu_pages": 4, "num_host_pages": 1}'


@pytest.mark.parametrize(
    "content, problem",
    [
        (
            b'{"name": "x",',
            (
                r"is not valid JSON: Expecting property name enclosed in double quotes \(line 1,"
                r" column 14\)"
            ),
        ),
        (b"\xff\xfe{}", r"is not valid UTF-8 \(invalid start byte at byte 0\)"),
        (
            '{"name": "x", "cache": {"num_gpu_pages": "many", "num_host_pages": 0}, "requests":'
            f" [{REQUEST}]}}".encode(),
            r"is invalid: cache.num_gpu_pages: Input should be a valid integer",
        ),
        (
            f'{{"name": "x", "cache": {CACHE}, "requests": [{{"uuid": "a", "prompt_ids": [1,'
            ' "two"], "max_new_tokens": 3}]}'.encode(),
            r"is invalid: requests.0.prompt_ids.1: Input should be a valid integer",
        ),
        (
            f'{{"name": "x", "cache": {CACHE}, "requests": [{{"uuid": "a", "prompt_ids": [1],'
            ' "max_new_tokens": -3, "arrival_step": -1}]}'.encode(),
            r"is invalid: requests.0.max_new_tokens: Input should be greater than or equal to 1; "
            r"requests.0.arrival_step: Input should be greater than or equal to 0$",
        ),
        (
            f'{{"name": "x", "cache": {CACHE}, "requests": [{REQUEST}, {REQUEST}]}}'.encode(),
            r"is invalid: <root>: Value error, request uuid 'a' appears twice$",
        ),
        (
            f'{{"name": "x", "cache": {CACHE}, "requests": []}}'.encode(),
            r"is invalid: requests: List should have at least 1 item",
        ),
        (b"[1, 2]", r"is invalid: <root>: Input should be a valid dictionary"),
    ],
    ids=[
        "bad-json",
        "invalid-utf8",
        "wrong-type",
        "wrong-token-type",
        "negative-numbers",
        "duplicate-uuid",
        "no-requests",
        "not-an-object",
    ],
)
def test_malformed_workload_file_names_the_problem(tmp_path, content, problem):
    path = tmp_path / "workload.json"
    path.write_bytes(content)
    with pytest.raises(WorkloadError, match=f"^workload file '{re.escape(str(path))}' {problem}"):
        load_workload(str(path))


def test_missing_workload_file_is_named(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(
        WorkloadError, match=f"^workload file '{re.escape(str(path))}' does not exist$"
    ):
        load_workload(str(path))


def test_run_workload_reports_the_releases_of_a_step_that_raises():
    """A step can release requests and then raise (a divergence in raise mode, Ctrl-C): those are
    reported too."""
    workload = builtin_workload("smoke", scale=0.5)
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_storage=False,
    )
    step = worker.step

    def step_then_raise():
        num_outputs = len(worker.state.outputs)
        step()
        if len(worker.state.outputs) > num_outputs:  # the first step that released a request
            raise KeyboardInterrupt

    worker.step = step_then_raise
    released = []
    with pytest.raises(KeyboardInterrupt):
        run_workload(worker, workload, on_release=released.append)
    assert released and [o.uuid for o in released] == list(worker.state.outputs)


def test_run_workload_reports_each_released_request_once_in_release_order():
    smoke = builtin_workload("smoke", scale=0.5)
    workload = smoke.model_copy(
        update={
            "requests": [
                *smoke.requests[:3],
                smoke.requests[3].model_copy(update={"abort_step": 2}),
            ]
        }
    )
    worker = Worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_storage=False,
    )
    released = []
    result = run_workload(worker, workload, on_release=released.append)
    assert [(o.uuid, o.phase.value, o.finish_reason, o.output_ids) for o in released] == [
        ("smoke-r3", "finished", "abort", ()),
        (
            "smoke-r1",
            "finished",
            "length",
            (273, 184, 92, 311, 375, 294, 226, 5, 285, 340, 168, 147, 3, 322),
        ),
        (
            "smoke-r0",
            "finished",
            "length",
            (
                450,
                131,
                501,
                442,
                312,
                33,
                11,
                312,
                238,
                127,
                97,
                374,
                228,
                413,
                247,
                116,
                282,
                379,
                461,
            ),
        ),
        ("smoke-r2", "finished", "length", (256, 446, 103, 401, 126, 372, 197, 487, 188, 362)),
    ]
    assert released == [result.outputs[o.uuid] for o in released]
    second = builtin_workload("smoke", seed=1, scale=0.25)
    second = second.model_copy(
        update={
            "requests": [r.model_copy(update={"uuid": f"second-{r.uuid}"}) for r in second.requests]
        }
    )
    # the same worker, whose outputs still hold the first run's: only the second's are reported
    released.clear()
    result = run_workload(worker, second, on_release=released.append)
    assert (
        sorted(o.uuid for o in released)
        == sorted(result.outputs)
        == ["second-smoke-r0", "second-smoke-r1"]
    )
