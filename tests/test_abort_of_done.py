"""An abort that lands on a request that is already done (finished or failed in the step just
taken, not released yet) changes nothing: the request keeps its finish reason and its tokens, on
either KV path, and compare mode sees both paths agree."""

import random

import pytest
from stepping import step_to_end

from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.request_checks import RequestError
from batchgen.engine.worker import Worker
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker
from batchgen.state import DONE_PHASES, Phase, Request

CACHE = CacheConfig(page_size=4, num_gpu_pages=10, num_host_pages=6)  # evicts every few steps


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def requests() -> list[Request]:
    rng = random.Random(3)
    return [
        Request(
            uuid=f"r{i}",
            prompt_ids=[rng.randrange(1, 512) for _ in range(rng.randint(5, 14))],
            max_new_tokens=rng.randint(4, 16),
        )
        for i in range(6)
    ]


def new_worker(model, kv_path: str, log) -> Worker:
    """A compare-mode worker that raises at the first divergence of the other path."""
    gate = KvGateConfig(path=kv_path, compare="raise", compare_log=str(log))
    worker = gated_worker(model, cache_config=CACHE, engine_config=EngineConfig(), kv_gate=gate)
    for request in requests():
        worker.add_request(request)
    return worker


def run_aborting_each_done_request(worker: Worker) -> list[str]:
    """Step to the end; after each step, abort every request that is done but not released yet.
    Returns the uuids aborted that way. Mutates ``worker``."""
    aborted = []
    for _ in range(2_000):
        if not worker.state.requests:
            return aborted
        worker.step()
        worker.check_integrity()
        for req in list(worker.state.requests.values()):
            if req.phase in DONE_PHASES:
                worker.abort(req.uuid)
                aborted.append(req.uuid)
    raise AssertionError("requests still live after 2000 steps")


def run_plainly(model) -> dict:
    worker = Worker(
        model,
        cache_config=CACHE,
        engine_config=EngineConfig(),
    )
    for request in requests():
        worker.add_request(request)
    step_to_end(worker, 2_000)
    return worker.take_outputs()


@pytest.mark.parametrize("kv_path", ["plan", "legacy"])
def test_an_abort_of_a_request_that_finished_this_step_keeps_its_finish_reason_and_output(
    model, kv_path, tmp_path
):
    reference = run_plainly(model)
    worker = new_worker(model, kv_path, tmp_path / "log.jsonl")
    aborted = run_aborting_each_done_request(worker)
    assert sorted(aborted) == sorted(reference)  # every request was aborted once done
    outputs = worker.take_outputs()
    assert {u: (o.phase, o.finish_reason) for u, o in outputs.items()} == {
        u: (Phase.FINISHED, o.finish_reason) for u, o in reference.items()
    }
    assert {o.finish_reason for o in reference.values()} == {"length"}
    assert {u: list(o.output_ids) for u, o in outputs.items()} == {
        u: list(o.output_ids) for u, o in reference.items()
    }
    assert worker.gpu_kv.free_pages() == CACHE.num_gpu_pages
    assert worker.host_kv.free_pages() == CACHE.num_host_pages
    summary = worker.kv_compare.end_run()
    assert sum(summary.divergences.values()) == 0 and summary.harness_errors == 0


def test_an_abort_of_a_request_already_released_is_rejected_as_no_longer_live(model, tmp_path):
    worker = new_worker(model, "plan", tmp_path / "log.jsonl")
    for _ in range(2_000):
        if "r0" not in worker.state.requests:
            break
        worker.step()
    with pytest.raises(RequestError, match=r"^abort: no live request 'r0'$"):
        worker.abort("r0")
    assert worker.state.outputs["r0"].finish_reason == "length"
