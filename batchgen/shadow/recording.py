"""What one compared KV op wrote, recorded by wrappers: the worker's state, pools and pending
appends record nothing themselves.

    wrapper            wraps                  records, while recording
    -----------------  ---------------------  ----------------------------------------------------
    RecordingState     the worker's state     ``written``: each request the op wrote, as it was
                                              before its first write (``edit``, ``remove``)
    RecordingPool      a pool                 ``journal``: its allocator's changes, as PoolEvents
    RecordingHostPool  the host pool          and ``copies``: the copies issued, in order;
                                              ``load_handles``: the handles its loads returned
    RecordedTarget     the worker's target    ``dropped``: the pending appends the op dropped

Compare mode runs the authoritative path of a compared op on ``recorded(target)`` between
``start`` and ``stop``; every call goes through to the worker's own parts. A fork
(``batchgen.shadow.fork``) is a ``RecordedTarget`` too, always recording, over a ``ForkedState``
and forked pools. With compare mode off nothing is wrapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from batchgen.kv.backends import CopyOp, HostKvPool, KvPool
from batchgen.kv.page_grants import Grants, SharedGrants
from batchgen.kv.target import KvTarget
from batchgen.state import Phase, RequestState, WorkerState


class PoolEvent(NamedTuple):
    """One change of a pool's allocator: ``kind`` is ``alloc`` (new pages), ``share`` (cached pages
    a request now holds too) or ``release`` (the pages it gave up). A journal holds one per page
    grant; compare mode compares journals as they are, event by event."""

    kind: str
    uuid: str
    page_ids: tuple[int, ...]


class RecordingState:
    """A worker's state whose writes (``edit``, ``remove``) go through to it; while ``written``
    is a dict, the first write of each request records it as it was."""

    __slots__ = ("_state", "written")

    def __init__(self, state: WorkerState):
        self._state = state
        self.written: dict[str, RequestState] | None = None

    @property
    def step(self) -> int:
        return self._state.step

    @property
    def requests(self) -> dict[str, RequestState]:
        return self._state.requests

    @property
    def outputs(self):
        return self._state.outputs

    @property
    def stats(self):
        return self._state.stats

    @property
    def num_submitted(self) -> int:
        return self._state.num_submitted

    def in_phase(self, *phases: Phase) -> list[RequestState]:
        return self._state.in_phase(*phases)

    def edit(self, uuid: str) -> RequestState:
        """The live request ``uuid``, recorded as it was on its first write. Mutates
        ``written``."""
        req = self._state.requests[uuid]
        written = self.written
        if written is not None and uuid not in written:
            written[uuid] = req.copy()
        return req

    def remove(self, uuid: str) -> RequestState:
        """Take the live request ``uuid`` out (recorded as ``edit`` records). Mutates the
        state's requests and ``written``."""
        req = self.edit(uuid)
        del self._state.requests[uuid]
        return req


class ForkedState:
    """A copy-on-write fork of a worker's state: the request dict and each request are the
    worker's until the fork writes them; ``written`` holds each request it wrote, as it was (the
    worker's object). Outputs and counters are its own."""

    __slots__ = ("step", "requests", "outputs", "stats", "num_submitted", "written")

    def __init__(self, state: WorkerState):
        self.step, self.requests, self.num_submitted = (
            state.step,
            state.requests,
            state.num_submitted,
        )
        self.outputs: dict = {}
        self.stats = state.stats.copy()
        self.written: dict[str, RequestState] = {}

    def in_phase(self, *phases: Phase) -> list[RequestState]:
        return [r for r in self.requests.values() if r.phase in phases]

    def edit(self, uuid: str) -> RequestState:
        """The fork's copy of request ``uuid``, made on its first write (the first write of any
        request copies the request dict too). Mutates ``requests`` and ``written``."""
        req = self.requests[uuid]
        written = self.written
        if uuid not in written:
            if not written:
                self.requests = dict(self.requests)
            written[uuid] = req
            self.requests[uuid] = req = req.copy()
        return req

    def remove(self, uuid: str) -> RequestState:
        """Take request ``uuid`` out of the fork. Mutates ``requests`` and ``written``."""
        req = self.edit(uuid)
        del self.requests[uuid]
        return req


class RecordingPool(KvPool):
    """A pool whose calls go through to it (its queries to its allocator, as the pool's own do);
    while ``journal`` is a list, each change of its allocator is appended to it."""

    def __init__(self, pool: KvPool):
        super().__init__(pool.pages, pool.tensor)
        self.pool = pool
        self.journal: list[PoolEvent] | None = None

    def allocate_pages(self, uuid: str, n: int) -> list[int]:
        """Mutates the pool and the journal."""
        page_ids = self.pool.allocate_pages(uuid, n)
        self._note("alloc", uuid, page_ids)
        return page_ids

    def take_pages(self, uuid: str, page_ids) -> None:
        """Mutates the pool and the journal."""
        self.take_pages_for(((uuid, page_ids),))

    def take_pages_for(self, grants: Grants) -> None:
        """Mutates the pool and the journal."""
        self.pool.take_pages_for(grants)
        for uuid, page_ids in grants:
            self._note("alloc", uuid, page_ids)

    def grant_pages_for(self, grants: SharedGrants) -> None:
        """Mutates the pool and the journal (each grant's shared pages, then its new ones)."""
        self.pool.grant_pages_for(grants)
        for uuid, shared, new in grants:
            self._note("share", uuid, shared)
            self._note("alloc", uuid, new)

    def release_pages(self, uuid: str) -> None:
        """Mutates the pool and the journal (the pages it released, if it did)."""
        page_ids = self.pages.pages_of(uuid)
        self.pool.release_pages(uuid)
        self._note("release", uuid, () if self.pages.pages_of(uuid) else page_ids)

    def release_first_pages(self, uuid: str, n: int) -> None:
        """Mutates the pool and the journal."""
        page_ids = self.pages.pages_of(uuid)[:n]
        self.pool.release_first_pages(uuid, n)
        self._note("release", uuid, page_ids)

    def _note(self, kind: str, uuid: str, page_ids) -> None:
        if self.journal is not None and page_ids:
            self.journal.append(PoolEvent(kind, uuid, tuple(page_ids)))


class RecordingHostPool(RecordingPool):
    """A host pool recording, besides its allocator's changes, the copies issued (``copies``)
    and the handle each load returned (``load_handles``: its id -> (the request loaded, the
    handle, held so that its id is not reused while the op is compared))."""

    def __init__(self, pool: HostKvPool):
        super().__init__(pool)
        self.copies: list[CopyOp] | None = None
        self.load_handles: dict | None = None

    def store_from_gpu(self, uuid: str, gpu_page_ids: list[int]) -> None:
        """Mutates the host pages and the records."""
        if self.copies is not None:
            self.copies.append(self.pool.copy_op("store", uuid, gpu_page_ids))
        self.pool.store_from_gpu(uuid, gpu_page_ids)

    def load_to_gpu_async(self, uuid: str, page_ids: list[int]):
        """Mutates the GPU pages (when the copy runs) and the records."""
        if self.copies is None:
            return self.pool.load_to_gpu_async(uuid, page_ids)
        self.copies.append(self.pool.copy_op("load", uuid, page_ids))
        handle = self.pool.load_to_gpu_async(uuid, page_ids)
        self.load_handles[id(handle)] = (uuid, handle)
        return handle


@dataclass(slots=True)
class RecordedTarget(KvTarget):
    """A target whose parts record what an op writes; ``dropped``: the pending appends the op
    dropped, while recording."""

    dropped: set[str] | None = None

    def drop_pending_append(self, uuid: str) -> None:
        """Mutates ``pending_appends`` and ``dropped``."""
        if uuid in self.pending_appends:
            del self.pending_appends[uuid]
            if self.dropped is not None:
                self.dropped.add(uuid)


def recorded(target: KvTarget) -> RecordedTarget:
    """``target``'s parts wrapped to record what an op writes, recording off. Pure."""
    return RecordedTarget(
        RecordingState(target.state),
        RecordingPool(target.gpu_kv),
        RecordingHostPool(target.host_kv),
        target.pending_appends,
        target.model_config,
        target.cache_config,
        target.engine_config,
    )


def start(target: RecordedTarget) -> None:
    """Record, from empty records, what the next op on ``target`` writes. Mutates the records."""
    target.state.written, target.dropped = {}, set()
    target.gpu_kv.journal, target.host_kv.journal = [], []
    target.host_kv.copies, target.host_kv.load_handles = [], {}


def stop(target: RecordedTarget) -> None:
    """Stop recording, and forget the records. Mutates them."""
    target.state.written = target.dropped = None
    target.gpu_kv.journal = target.host_kv.journal = None
    target.host_kv.copies = target.host_kv.load_handles = None
