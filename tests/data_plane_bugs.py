"""Data-plane bugs for the page-content oracle's tests, and the workload that shows them: one
request's KV stored to host and loaded back once."""

from __future__ import annotations

import numpy as np

from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.workloads import Workload, WorkloadRequest
from batchgen.kv import copy_runs
from batchgen.model.paged_kv import write_kvs

REAL_PAIR_RUNS = copy_runs.pair_runs


def one_round_trip() -> Workload:
    """Two requests over 6 GPU pages of 4 tokens: r1, the younger (11 prompt tokens, 3 pages), is
    evicted to host once, as one consecutive run, and loaded back once."""
    requests = [
        WorkloadRequest(uuid="r0", prompt_ids=[5, 17, 42, 8, 99, 3, 61], max_new_tokens=5),
        WorkloadRequest(
            uuid="r1",
            prompt_ids=[7, 300, 12, 45, 2, 88, 140, 9, 31, 77, 6],
            max_new_tokens=6,
            arrival_step=1,
        ),
    ]
    cache = CacheConfig(page_size=4, num_gpu_pages=6, num_host_pages=8)
    return Workload(
        name="round-trip", cache=cache, engine=EngineConfig(max_num_seqs=4), requests=requests
    )


def runs_whose_destination_does_not_advance(src_index, dst_index):
    """``copy_runs.pair_runs`` with a bug: a merged run's pages all go to its first destination."""
    src_starts, dst_starts, lengths = REAL_PAIR_RUNS(src_index, dst_index)
    src = np.concatenate([np.arange(s, s + n) for s, n in zip(src_starts, lengths)])
    dst = np.repeat(dst_starts, lengths)
    return src, dst, np.ones(len(src), dtype=lengths.dtype)


def writes_one_slot_late(kv_pages, writes):
    """``write_kvs`` with a bug: every append lands one position after its own."""
    write_kvs(kv_pages, [(page_ids, start + 1, kv) for page_ids, start, kv in writes])
