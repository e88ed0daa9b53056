"""Worker: pool integrity every step, no leaks, the same tokens under eviction, failed loads,
aborts, bad input."""

import random
import re

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from stepping import step_to_end

from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.request_checks import RequestError
from batchgen.engine.runner import RunResult, run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest, builtin_workload
from batchgen.kv import tiers
from batchgen.kv.tiers import PoolAllocationError
from batchgen.model import loader
from batchgen.model.loader import load_model
from batchgen.state import Phase, Request
from batchgen.validation.output_check import compare_exact, compare_outputs


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def pressure_workload(
    prefix: str = "p", *, temperature: float = 0.0, num_host_pages: int = 6
) -> Workload:
    """8 requests arriving together, 20-40 tokens each, over 10 GPU pages of 4 tokens: a lot of
    eviction."""
    rng = random.Random(1)
    requests = [
        WorkloadRequest(
            uuid=f"{prefix}{i}",
            prompt_ids=[rng.randrange(1, 512) for _ in range(rng.randint(5, 14))],
            max_new_tokens=rng.randint(10, 20),
            temperature=temperature,
            seed=i,
        )
        for i in range(8)
    ]
    cache = CacheConfig(page_size=4, num_gpu_pages=10, num_host_pages=num_host_pages)
    return Workload(
        name=f"pressure-{prefix}",
        cache=cache,
        engine=EngineConfig(max_num_seqs=8),
        requests=requests,
    )


def without_pressure(workload: Workload) -> Workload:
    """The same workload over a GPU pool that holds every request at full length at once."""
    return workload.with_cache(num_gpu_pages=200, num_host_pages=0)


def new_worker(model, workload: Workload) -> Worker:
    return Worker(model, cache_config=workload.cache, engine_config=workload.engine)


def run(model, workload: Workload) -> RunResult:
    """``workload`` on a fresh worker, pools checked after every step."""
    return run_workload(new_worker(model, workload), workload, check_integrity=True)


def assert_nothing_left(result: RunResult) -> None:
    assert (
        result.leaked_gpu_pages,
        result.leaked_host_pages,
        result.loads_in_flight,
        result.live_requests,
    ) == (0, 0, 0, 0)


def finish(worker: Worker) -> None:
    """Step until every request is released, checking the pools after every step."""
    step_to_end(worker, 5_000, check_integrity=True)


@pytest.fixture(scope="module")
def pressured(model) -> RunResult:
    return run(model, pressure_workload())


@pytest.fixture(scope="module")
def reference(model) -> RunResult:
    result = run(model, without_pressure(pressure_workload()))
    assert (result.stats.evictions, result.stats.loads, result.stats.recompute_preemptions) == (
        0,
        0,
        0,
    )
    return result


# ---- integrity and leaks ---------------------------------------------------------------------
def test_pools_stay_consistent_after_every_step_of_smoke(model):
    result = run(model, builtin_workload("smoke"))
    assert result.stats.evictions > 0
    assert_nothing_left(result)


def test_pools_stay_consistent_after_every_step_of_an_l2_run(model):
    # 8 requests; this seed evicts at this scale
    workload = builtin_workload("L2-2048", scale=0.25, seed=4)
    result = run(model, workload)
    assert result.stats.evictions > 0 and result.stats.loads == result.stats.evictions
    assert_nothing_left(result)
    assert len(result.outputs) == 8


def test_back_to_back_runs_on_one_worker_leave_nothing_behind(model):
    smoke = builtin_workload("smoke")
    second = pressure_workload("second").model_copy(update={"cache": smoke.cache})
    worker = new_worker(model, smoke)
    assert_nothing_left(run_workload(worker, smoke, check_integrity=True))
    after_two = run_workload(worker, second, check_integrity=True)
    assert_nothing_left(after_two)
    fresh = run(model, second)
    assert compare_exact(fresh.outputs, after_two.outputs) == []
    assert (after_two.num_steps, after_two.stats.evictions) == (
        fresh.num_steps,
        fresh.stats.evictions,
    )


# ---- tokens under pressure -------------------------------------------------------------------
def test_tokens_under_heavy_eviction_equal_tokens_without_pressure(pressured, reference):
    result = pressured
    assert result.stats.evictions >= 4 and result.stats.recompute_preemptions >= 1
    assert_nothing_left(result)
    assert compare_outputs(reference.outputs, result.outputs) == []


def test_sampled_tokens_are_the_same_with_and_without_eviction(model, reference):
    sampled = pressure_workload(temperature=0.8)
    pressured, relaxed = run(model, sampled), run(model, without_pressure(sampled))
    assert pressured.stats.evictions > 0 and relaxed.stats.evictions == 0
    assert compare_exact(relaxed.outputs, pressured.outputs) == []
    # sampling really departs from greedy
    assert compare_exact(reference.outputs, relaxed.outputs) != []


# ---- failed loads ----------------------------------------------------------------------------
class FailedCopy:
    """A load handle whose copy failed."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError("injected copy failure")


def fail_first_loads(monkeypatch, worker: Worker, num_failures: int) -> list[str]:
    """Make the first ``num_failures`` loads fail; returns the uuids they were for, as they
    happen."""
    real_load = worker.host_kv.load_to_gpu_async
    failed: list[str] = []

    def load(uuid, page_ids):
        if len(failed) < num_failures:
            failed.append(uuid)
            return FailedCopy()
        return real_load(uuid, page_ids)

    monkeypatch.setattr(worker.host_kv, "load_to_gpu_async", load)
    return failed


def test_a_failed_load_is_retried_and_the_retry_succeeds(model, monkeypatch, reference):
    # host never full: no recompute unless a load fails twice
    workload = pressure_workload(num_host_pages=40)
    worker = new_worker(model, workload)
    failed = fail_first_loads(monkeypatch, worker, 1)
    result = run_workload(worker, workload, check_integrity=True)
    assert len(failed) == 1
    assert (result.stats.load_failures, result.stats.recompute_preemptions) == (1, 0)
    assert_nothing_left(result)
    assert compare_outputs(reference.outputs, result.outputs) == []


def test_a_load_that_fails_again_on_retry_ends_in_recompute(model, monkeypatch, reference):
    workload = pressure_workload(num_host_pages=40)
    worker = new_worker(model, workload)
    failed = fail_first_loads(monkeypatch, worker, 2)
    result = run_workload(worker, workload, check_integrity=True)
    assert failed[0] == failed[1]  # the retry of the same request failed too
    assert (result.stats.load_failures, result.stats.recompute_preemptions) == (2, 1)
    assert_nothing_left(result)
    assert compare_outputs(reference.outputs, result.outputs) == []


# ---- aborts ----------------------------------------------------------------------------------
def worker_with_requests(model, workload: Workload) -> Worker:
    worker = new_worker(model, workload)
    for request in workload.requests:
        worker.add_request(request.to_request())
    return worker


def step_until(worker: Worker, phase: Phase) -> str:
    """Step until some request is in ``phase`` (checking pools each step); returns the youngest such
    uuid."""
    for _ in range(500):
        in_phase = worker.state.in_phase(phase)
        if in_phase:
            return in_phase[-1].uuid
        worker.step()
        worker.check_integrity()
    raise AssertionError(f"no request reached {phase} in 500 steps")


@pytest.mark.parametrize(
    "phase, num_steps",
    [(Phase.WAITING, 0), (Phase.RUNNING, 1), (Phase.SWAPPED, None), (Phase.LOADING, None)],
    ids=["waiting", "prefilling", "swapped", "loading"],
)
def test_abort_leaves_no_leak_and_other_requests_unchanged(model, reference, phase, num_steps):
    worker = worker_with_requests(model, pressure_workload())
    for _ in range(num_steps or 0):
        worker.step()
    uuid = step_until(worker, phase)
    held_tokens = list(worker.state.requests[uuid].output_ids)
    if phase is Phase.RUNNING:
        assert len(held_tokens) == 1  # prefilled in the step just taken; its K/V still pending
    worker.abort(uuid)
    finish(worker)
    outputs = worker.state.outputs
    aborted = outputs.pop(uuid)
    assert (aborted.phase, aborted.finish_reason, list(aborted.output_ids)) == (
        Phase.FINISHED,
        "abort",
        held_tokens,
    )
    assert list(aborted.output_ids) == list(reference.outputs[uuid].output_ids[: len(held_tokens)])
    others = {u: out for u, out in reference.outputs.items() if u != uuid}
    assert compare_outputs(others, outputs) == []
    assert worker.gpu_kv.free_pages() == worker.gpu_kv.num_pages
    assert worker.host_kv.free_pages() == worker.host_kv.num_pages
    assert not worker.state.requests


def test_aborting_an_unknown_request_is_rejected(model):
    worker = worker_with_requests(model, pressure_workload())
    with pytest.raises(RequestError, match=r"^abort: no live request 'nope'$"):
        worker.abort("nope")


# ---- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "request_, message",
    [
        (
            Request("long", (1,) * 4600, 9),
            r"^request 'long': prompt \(4600\) \+ max_new_tokens \(9\) = 4609 exceeds "
            r"the model's context of 4608 tokens$",
        ),
        (
            Request("wide", (1,) * 60, 4),
            r"^request 'wide': needs 16 KV pages but the GPU pool has 9 usable pages "
            r"\(10 minus the watermark\)$",
        ),
        (
            Request("empty", (), 4),
            r"^request 'empty': empty prompt; a prompt needs at least one token$",
        ),
        (Request("zero", (1, 2), 0), r"^request 'zero': max_new_tokens=0; must be >= 1$"),
        (
            Request("vocab", (1, -1, 512, 3), 4),
            r"^request 'vocab': token ids \[-1, 512\] outside the vocabulary " r"\[0, 512\)$",
        ),
        (
            Request("cold", (1, 2), 4, temperature=-0.5),
            r"^request 'cold': temperature=-0.5; must be a finite number >= 0 \(0 = greedy\)$",
        ),
        (
            Request("nan", (1, 2), 4, temperature=float("nan")),
            r"^request 'nan': temperature=nan; must be a finite number >= 0 \(0 = greedy\)$",
        ),
        (
            Request("hot", (1, 2), 4, temperature=float("inf")),
            r"^request 'hot': temperature=inf; must be a finite number >= 0 \(0 = greedy\)$",
        ),
        (
            Request("p3", (1, 2), 4),
            r"^request 'p3': uuid already used; uuids must be unique per worker$",
        ),
        (
            Request("fault:gpu-refuse:1", (1, 2), 4),
            r"^request 'fault:gpu-refuse:1': uuids starting with 'fault:' are "
            r"reserved \(fault injection holds pool pages under them\)$",
        ),
        (
            Request("float", (1.0, 2.0), 4),
            r"^request 'float': prompt_ids must be ints; got \[1\.0, 2\.0\]$",
        ),
        (Request("bool", (True, 2), 4), r"^request 'bool': prompt_ids must be ints; got \[True\]$"),
        (
            Request("array", torch.tensor([1, 2]), 4),
            r"^request 'array': prompt_ids must be a tuple of ints, not Tensor "
            r"\(convert an array or tensor with tuple\(ids\.tolist\(\)\)\)$",
        ),
        (Request("text", "12", 4), r"^request 'text': prompt_ids must be a tuple of ints, not str"),
        (Request(5, (1, 2), 4), r"^request uuid 5: must be a str, not int$"),
        (
            Request("half", (1, 2), 2.5),
            r"^request 'half': max_new_tokens must be an int, not float 2\.5$",
        ),
        (
            Request("seed", (1, 2), 4, seed="x"),
            r"^request 'seed': seed must be an int, not str 'x'$",
        ),
        (
            Request("warm", (1, 2), 4, temperature="0.5"),
            r"^request 'warm': temperature must be a number, not str '0\.5'$",
        ),
    ],
    ids=[
        "longer-than-context",
        "larger-than-pool",
        "empty-prompt",
        "no-new-tokens",
        "outside-vocab",
        "negative-temperature",
        "nan-temperature",
        "infinite-temperature",
        "duplicate-uuid",
        "fault-owner-uuid",
        "float-token",
        "bool-token",
        "tensor-prompt",
        "str-prompt",
        "int-uuid",
        "float-max-new-tokens",
        "str-seed",
        "str-temperature",
    ],
)
def test_bad_request_is_rejected_and_changes_nothing(model, pressured, request_, message):
    worker = worker_with_requests(model, pressure_workload())
    worker.step()
    before = (
        dict(worker.state.requests),
        worker.state.num_submitted,
        worker.state.step,
        worker.gpu_kv.free_pages(),
        worker.host_kv.free_pages(),
    )
    with pytest.raises(RequestError, match=message):
        worker.add_request(request_)
    assert (
        dict(worker.state.requests),
        worker.state.num_submitted,
        worker.state.step,
        worker.gpu_kv.free_pages(),
        worker.host_kv.free_pages(),
    ) == before
    finish(worker)
    assert compare_exact(pressured.outputs, worker.state.outputs) == []


def test_a_released_uuid_cannot_be_reused(model):
    worker = worker_with_requests(model, pressure_workload())
    finish(worker)
    with pytest.raises(RequestError, match=r"^request 'p0': uuid already used"):
        worker.add_request(Request("p0", (1, 2), 4))


def test_take_outputs_removes_what_it_returns_and_leaves_the_rest(model):
    workload = builtin_workload("smoke")
    worker = Worker(model, cache_config=workload.cache, engine_config=workload.engine)
    result = run_workload(worker, workload)
    first, *rest = sorted(result.outputs)
    with pytest.raises(TypeError, match=rf"use take_outputs\(\['{first}'\]\)"):
        worker.take_outputs(first)  # one uuid, not a collection: refused, nothing taken
    assert sorted(worker.state.outputs) == [first, *rest]
    assert worker.take_outputs([first, "never-submitted"]) == {first: result.outputs[first]}
    assert sorted(worker.state.outputs) == rest
    assert worker.take_outputs() == {u: result.outputs[u] for u in rest}
    assert worker.state.outputs == {}


def test_a_temperature_too_small_to_divide_by_samples_greedily(model):
    """1e-300 would overflow the logits to infinity; below GREEDY_BELOW the argmax is taken, as for
    0."""
    outputs = []
    for temperature in (0.0, 1e-300, 1e-6):
        worker = worker_with_requests(model, pressure_workload("t", temperature=temperature))
        finish(worker)
        outputs.append({uuid: out.output_ids for uuid, out in worker.state.outputs.items()})
    assert outputs[1] == outputs[2] == outputs[0]
    assert len(outputs[0]) == 8


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"cache_config": None},
            "Worker: cache_config must be a batchgen.config.CacheConfig, not NoneType",
        ),
        (
            {"engine_config": {"max_num_seqs": 4}},
            "Worker: engine_config must be a batchgen.config.EngineConfig or None, not dict",
        ),
    ],
    ids=["cache", "engine"],
)
def test_a_config_of_another_type_is_a_type_error_naming_the_argument(model, config, message):
    arguments = {
        "cache_config": CacheConfig(page_size=4, num_gpu_pages=8, num_host_pages=0),
        **config,
    }
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        Worker(model, **arguments)


def test_pools_past_the_memory_available_are_refused_before_any_is_allocated(model, monkeypatch):
    """Both tiers live in host memory on a CPU run; the page tensors are zero-filled, so a pool past
    what is available would have the OS kill the process part way through."""
    allocated = []
    monkeypatch.setattr(tiers, "new_page_tensor", lambda *args, **kwargs: allocated.append(args))
    # float32
    page_bytes = (
        model.config.num_layers * 2 * 4 * model.config.num_kv_heads * model.config.head_dim * 4
    )
    cache = CacheConfig(page_size=4, num_gpu_pages=8, num_host_pages=2)
    monkeypatch.setattr(loader, "host_memory_available", lambda: 10 * page_bytes - 1)
    with pytest.raises(
        PoolAllocationError,
        match=re.escape(
            f"the KV pools need 0.0 GiB on cpu (8 GPU-tier + 2 host-tier pages of {page_bytes}"
            " bytes), 0.0 GiB is available; lower num_gpu_pages/num_host_pages (or page_size)"
        ),
    ):
        Worker(model, cache_config=cache)
    assert allocated == []
    for available in (10 * page_bytes, None):  # exactly enough; or a system that does not say
        monkeypatch.setattr(loader, "host_memory_available", lambda a=available: a)
        Worker(model, cache_config=cache)
    assert len(allocated) == 4


def test_take_outputs_of_something_that_is_no_collection_is_a_type_error(model):
    worker = Worker(model, cache_config=CacheConfig(page_size=4, num_gpu_pages=8, num_host_pages=0))
    with pytest.raises(TypeError, match=r"^take_outputs takes a collection of uuids, not int 5$"):
        worker.take_outputs(5)
    with pytest.raises(TypeError, match=r"^take_outputs takes a collection of uuids, not the str"):
        worker.take_outputs("r0")  # one uuid: its characters are no uuids


def test_numpy_scalars_are_accepted_where_ints_and_floats_are(model):
    outputs = []
    for request in (
        Request("r", tuple(np.array([1, 2, 3])), np.int64(3), np.float64(0.5), np.int64(7)),
        Request("r", (1, 2, 3), 3, 0.5, 7),
    ):
        worker = Worker(
            model, cache_config=CacheConfig(page_size=4, num_gpu_pages=16, num_host_pages=0)
        )
        worker.add_request(request)
        step_to_end(worker, 100)
        outputs.append(worker.take_outputs()["r"].output_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 3


@pytest.mark.parametrize("pages", [True, "8", 8.0], ids=["bool", "str", "float"])
def test_configs_built_in_python_are_as_strict_as_workload_files(pages):
    with pytest.raises(ValidationError, match="num_gpu_pages"):
        CacheConfig(num_gpu_pages=pages, num_host_pages=0)
    with pytest.raises(ValidationError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=pages)
