"""Which waiting requests a step admits, and in what order: the engine's ``schedule_policy``."""

import pytest

from batchgen.cli.run_flags import SCHEDULE_POLICIES
from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.runner import run_workload
from batchgen.engine.scheduler import ADMISSION_ORDER, schedule
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest
from batchgen.model.loader import load_model
from batchgen.state import Request, TokenLogprobs

CACHE = CacheConfig(page_size=4, num_gpu_pages=64, num_host_pages=0, watermark=0.0)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def waiting_worker(model, policy: str, max_new_tokens: list[int], max_num_seqs: int) -> Worker:
    engine = EngineConfig(max_num_seqs=max_num_seqs, schedule_policy=policy)
    worker = Worker(model, cache_config=CACHE, engine_config=engine)
    for i, num_new in enumerate(max_new_tokens):
        worker.add_request(Request(f"r{i}", (1, 2, 3), num_new))
    return worker


def first_batch(worker: Worker) -> list[str]:
    return schedule(
        worker.state, worker.gpu_kv.free_pages(), worker.cache_config, worker.engine_config
    )


def test_every_policy_the_config_and_the_cli_accept_has_an_admission_order():
    assert sorted(ADMISSION_ORDER) == sorted(SCHEDULE_POLICIES) == ["fcfs", "lof"]


def test_fcfs_admits_the_oldest_first(model):
    worker = waiting_worker(model, "fcfs", [10, 50, 30, 50], max_num_seqs=2)
    assert first_batch(worker) == ["r0", "r1"]


def test_lof_admits_the_most_new_tokens_first_oldest_first_among_equals(model):
    worker = waiting_worker(model, "lof", [10, 50, 30, 50], max_num_seqs=3)
    assert first_batch(worker) == ["r1", "r3", "r2"]


def test_lof_counts_the_tokens_a_recomputed_request_still_may_generate(model):
    worker = waiting_worker(model, "lof", [10, 50, 30], max_num_seqs=2)
    recomputed = worker.state.requests["r1"]
    for _ in range(45):  # 5 of its 50 left: after r2 (30) and r0 (10)
        recomputed.append_token(7, TokenLogprobs((7, 8), (0.0, -1.0)))
    assert first_batch(worker) == ["r2", "r0"]


def test_lof_ends_requests_of_unequal_lengths_in_fewer_steps_with_the_same_tokens(model):
    lengths = [4, 4, 4, 40, 4, 4, 4, 40]
    runs = {}
    for policy in ("fcfs", "lof"):
        workload = Workload(
            name=policy,
            cache=CACHE,
            engine=EngineConfig(max_num_seqs=2, schedule_policy=policy),
            requests=[
                WorkloadRequest(uuid=f"r{i}", prompt_ids=[i + 1, 2, 3], max_new_tokens=n)
                for i, n in enumerate(lengths)
            ],
        )
        worker = Worker(model, cache_config=workload.cache, engine_config=workload.engine)
        runs[policy] = run_workload(worker, workload)
    # fcfs: r7 starts only after the five short ones ahead of it in its slot, and runs long after
    # r3 ended; lof: r3 and r7 start at once and the short ones follow, two at a time
    assert (runs["fcfs"].num_steps, runs["lof"].num_steps) == (61, 53)
    fcfs, lof = (
        {uuid: out.output_ids for uuid, out in runs[p].outputs.items()} for p in ("fcfs", "lof")
    )
    assert fcfs == lof
