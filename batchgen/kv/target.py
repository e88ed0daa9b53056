"""What a KV op reads and mutates, bundled: the target both KV paths work on.

The worker's own target holds references to its live state, pools and pending
appends, so an op on it mutates the worker. Compare mode builds a second target
around forked copies (bookkeeping only) to run the shadow path on.

KV ops drop pending appends only through :meth:`KvTarget.drop_pending_append`:
while ``dropped`` is a set (compare mode, one op) it records what was dropped, and
a fork (``shared_pending``) only records, leaving the worker's dict as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchgen.config import CacheConfig, EngineConfig, ModelConfig
from batchgen.engine.state import WorkerState
from batchgen.kv.backends import GpuKvPool, HostKvPool


@dataclass(slots=True)
class KvTarget:
    state: WorkerState
    gpu_kv: GpuKvPool
    host_kv: HostKvPool
    pending_appends: Mapping[str, Any]  # the worker's _pending_kv_append_tensors
    model_config: ModelConfig
    cache_config: CacheConfig
    engine_config: EngineConfig
    dropped: set[str] | None = None  # pending appends dropped while an op is compared
    shared_pending: bool = False  # a fork: pending_appends is the worker's, never written

    def record_op(self, on: bool) -> None:
        """Start (fresh, empty records) or stop recording what one KV op writes: both pools'
        journals, the copies issued and load handles returned, the requests written (each as it was
        before) and the pending appends dropped. Mutates those records."""
        self.gpu_kv.pages.journal = [] if on else None
        self.host_kv.pages.journal = [] if on else None
        self.host_kv.record_copies(on)
        self.state.written = {} if on else None
        self.dropped = set() if on else None

    def drop_pending_append(self, uuid: str) -> None:
        """Discard ``uuid``'s pending K/V, if any. Mutates ``pending_appends`` (a fork: ``dropped``
        only)."""
        if uuid not in self.pending_appends or (self.shared_pending and uuid in self.dropped):
            return
        if not self.shared_pending:
            del self.pending_appends[uuid]
        if self.dropped is not None:
            self.dropped.add(uuid)

    def has_pending_append(self, uuid: str) -> bool:
        return uuid in self.pending_appends and not (self.shared_pending and uuid in self.dropped)
