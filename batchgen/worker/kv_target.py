"""What a KV op reads and mutates, bundled: the target both KV paths work on.

The worker's own target holds references to its live state, pools and pending
appends, so an op on it mutates the worker. Compare mode builds a second target
around forked copies (bookkeeping only) to run the shadow path on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.config import CacheConfig, EngineConfig, ModelConfig
from batchgen.worker.kv_backends import GpuKvPool, HostKvPool
from batchgen.worker.state import WorkerState


@dataclass(slots=True)
class KvTarget:
    state: WorkerState
    gpu_kv: GpuKvPool
    host_kv: HostKvPool
    pending_appends: dict[str, Any]  # the worker's _pending_kv_append_tensors
    model_config: ModelConfig
    cache_config: CacheConfig
    engine_config: EngineConfig
