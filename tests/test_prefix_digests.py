"""The prefix cache's page keys, and the scheduler's view of a cached prefix: what a full page is,
how digests chain, and that an admission counts only the tokens and pages its hit leaves."""

import hashlib

import pytest

from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.scheduler import schedule
from batchgen.kv.backends import GpuKvPool
from batchgen.kv.prefix_digests import prompt_page_digests, reusable_pages
from batchgen.state import Request, RequestState, WorkerState


def blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def test_a_page_digest_chains_the_page_before_it_and_only_full_pages_have_one():
    page0 = (1).to_bytes(4, "little") + (2).to_bytes(4, "little")
    page1 = (3).to_bytes(4, "little") + (4).to_bytes(4, "little")
    d0 = blake(page0)
    d1 = blake(bytes.fromhex(d0) + page1)
    assert prompt_page_digests((1, 2, 3, 4), page_size=2) == (d0, d1)
    assert prompt_page_digests((1, 2, 3, 4, 5), page_size=2) == (d0, d1)
    assert prompt_page_digests((1, 2, 3), page_size=2) == (d0,)
    assert prompt_page_digests((1,), page_size=2) == ()


@pytest.mark.parametrize(
    "num_tokens, page_size, num_digests", [(6, 3, 2), (7, 3, 2), (8, 3, 2), (9, 2, 4), (9, 3, 3)]
)
def test_every_full_page_has_a_digest_and_no_partial_one(num_tokens, page_size, num_digests):
    prompt = tuple(range(1, num_tokens + 1))
    assert len(prompt_page_digests(prompt, page_size)) == num_digests


def test_the_same_page_after_another_prefix_has_another_digest():
    assert prompt_page_digests((9, 9, 3, 4), 2)[1] != prompt_page_digests((1, 2, 3, 4), 2)[1]


def test_hits_stop_one_token_short_of_a_prompt_of_whole_pages():
    assert reusable_pages(num_digests=2, num_tokens=4, page_size=2) == 1
    assert reusable_pages(num_digests=2, num_tokens=5, page_size=2) == 2
    assert reusable_pages(num_digests=2, num_tokens=9, page_size=2) == 2


def waiting(uuid: str, prompt: tuple[int, ...], index: int, page_size: int) -> RequestState:
    digests = prompt_page_digests(prompt, page_size)
    return RequestState(Request(uuid, prompt, 4), arrival_index=index, prompt_digests=digests)


def test_an_admission_counts_only_the_tokens_and_pages_its_cached_prefix_leaves():
    """Budget 9 tokens, 4-token pages: r0 (a cached 8-token prefix, 10 tokens) computes 2 tokens
    and takes 1 new page, so r1 (7 tokens, nothing cached) still fits the 7 tokens left."""
    cache = CacheConfig(page_size=4, num_gpu_pages=8, num_host_pages=0, watermark=0.0,
                        enable_prefix_caching=True)  # fmt: skip
    engine = EngineConfig(max_num_batched_tokens=9, max_num_seqs=4)
    gpu = GpuKvPool(8)
    system = tuple(range(1, 9))
    gpu.allocate_pages("holder", 2)
    for page_id, digest in zip((0, 1), prompt_page_digests(system, 4)):
        gpu.register(page_id, digest)
    state = WorkerState()
    state.requests = {
        "r0": waiting("r0", (*system, 20, 21), 0, 4),
        "r1": waiting("r1", (30, 31, 32, 33, 34, 35, 36), 1, 4),
    }
    assert schedule(state, gpu.free_pages(), cache, engine, gpu) == ["r0", "r1"]
    assert schedule(state, gpu.free_pages(), cache, engine) == ["r0"]  # without the index


def test_a_request_starting_with_the_page_another_computes_this_step_waits_a_step():
    cache = CacheConfig(page_size=4, num_gpu_pages=16, num_host_pages=0, watermark=0.0,
                        enable_prefix_caching=True)  # fmt: skip
    state = WorkerState()
    prompt = (1, 2, 3, 4, 5, 6)
    state.requests = {f"s{i}": waiting(f"s{i}", prompt, i, 4) for i in range(3)}
    state.requests["other"] = waiting("other", (7, 8, 9, 10, 11), 3, 4)
    gpu = GpuKvPool(16)
    assert schedule(state, 16, cache, EngineConfig(), gpu) == ["s0", "other"]
