"""What a KV op reads and mutates, bundled: the target both KV paths work on.

The worker's own target holds references to its live state, pools and pending
appends, so an op on it mutates the worker. Compare mode builds other targets
around the same parts (``batchgen.shadow.recording``: wrappers that record what an
op writes) and around forked copies (``batchgen.shadow.fork``) to run the shadow
path on. KV ops drop pending appends only through :meth:`KvTarget.drop_pending_append`.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from batchgen.config import CacheConfig, EngineConfig, ModelConfig
from batchgen.kv.backends import GpuKvPool, HostKvPool
from batchgen.state import WorkerState


@dataclass(slots=True)
class KvTarget:
    state: WorkerState
    gpu_kv: GpuKvPool
    host_kv: HostKvPool
    pending_appends: MutableMapping[str, Any]  # the worker's _pending_kv_append_tensors
    model_config: ModelConfig
    cache_config: CacheConfig
    engine_config: EngineConfig

    def drop_pending_append(self, uuid: str) -> None:
        """Discard ``uuid``'s pending K/V, if any. Mutates ``pending_appends``."""
        if uuid in self.pending_appends:
            del self.pending_appends[uuid]

    def has_pending_append(self, uuid: str) -> bool:
        return uuid in self.pending_appends
