"""Where a replicated job's replicas run: Ray actors (on a local instance or a cluster), or local
processes. Each replica lives in a host of its own (a ``ReplicaHost``: one actor, or one worker
process) and runs one call at a time, in the order the calls were made::

    pool.start(slots)          load a replica in each slot; {slot: handle of its load}
    pool.run_block(slot, b)    handle of the block's BlockResult        (queued behind the others)
    pool.finish(slot)          handle of its compare run's last records
    pool.wait(handles, t)      the handles that ended within t seconds (all of them: ``every``)
    pool.result(handle)        the value; ReplicaDied saying how the replica ended
    pool.stop(slot)            the replica killed at once
    pool.close()               every replica killed, a local Ray instance this pool started shut

Memory: a replica sizes its pools from 1/share of its node's caps, share being the replicas on
that node: all of them for processes; for Ray (``ray_pool``), the replicas the cluster placed there
(each actor reports its node before it loads).
"""

from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from batchgen.replicas.replica import Block, Replica, ReplicaFactory, ReplicaSpec, node_name
from batchgen.sweep.process_backend import kill_pool, new_pool
from compare import exception_text

DRIVER_CHECK_S = 1.0  # how often a process replica checks that its driver is still there
PROCESS_DIED = "its process died (killed, out of memory or crashed)"
# what a replica's worker process imports once, in the server it is forked from
REPLICA_PRELOAD = ("batchgen.cli.generate_replicas",)


class ReplicaDied(Exception):
    """A replica ended: its process died, its node was lost, or it raised; the message says how."""


class ReplicaStartError(Exception):
    """A replica could not load (its model missing on its node, say); the message names the node
    and the reason."""


class ReplicaHost:
    """Holds one replica: a Ray actor's class, or the state of a worker process."""

    def __init__(self) -> None:
        self.replica: Replica | None = None

    def node(self) -> str:
        return node_name()

    def load(self, factory: ReplicaFactory, spec: ReplicaSpec, share: int):
        """Build the replica; its ReplicaInfo. ReplicaStartError naming the node and the reason."""
        try:
            self.replica = factory(spec, share)
        except Exception as error:
            raise ReplicaStartError(f"on node {node_name()}: {exception_text(error)}") from None
        return self.replica.info()

    def run_block(self, block: Block):
        return self.replica.run_block(block)

    def finish(self) -> tuple[str, ...]:
        return self.replica.finish()


class ReplicaPool(ABC):
    """Replicas in numbered slots (see the module docstring)."""

    def __init__(self, num_replicas: int, factory: ReplicaFactory, spec: ReplicaSpec):
        self.num_replicas, self.factory, self.spec = num_replicas, factory, spec

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @abstractmethod
    def start(self, slots: list[int]) -> dict[int, Any]: ...

    @abstractmethod
    def run_block(self, slot: int, block: Block) -> Any: ...

    @abstractmethod
    def finish(self, slot: int) -> Any: ...

    @abstractmethod
    def wait(self, handles: list, timeout_s: float, *, every: bool = False) -> list: ...

    @abstractmethod
    def result(self, handle) -> Any: ...

    @abstractmethod
    def stop(self, slot: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


# ---- local processes -----------------------------------------------------------------------------
_HOST = ReplicaHost()  # a worker process's replica


def _host_load(factory: ReplicaFactory, spec: ReplicaSpec, share: int, driver_pid: int):
    threading.Thread(target=_exit_without, args=(driver_pid,), daemon=True).start()
    return _HOST.load(factory, spec, share)


def _exit_without(driver_pid: int) -> None:
    """End this process once the driver is gone (killed, SIGKILL included): a worker forked from
    the forkserver holds the ends of its own pipes, so nothing else would end it."""
    while True:
        time.sleep(DRIVER_CHECK_S)
        try:
            os.kill(driver_pid, 0)
        except (ProcessLookupError, PermissionError):  # PermissionError: another's took its pid
            os._exit(1)


def _host_run_block(block: Block):
    return _HOST.run_block(block)


def _host_finish() -> tuple[str, ...]:
    return _HOST.finish()


class ProcessReplicas(ReplicaPool):
    """Each replica in a worker process of its own on this machine (a one-process pool, forked
    from a server that imported the engine once); all on this node, so each gets 1/N of the caps."""

    def __init__(self, num_replicas: int, factory: ReplicaFactory, spec: ReplicaSpec):
        super().__init__(num_replicas, factory, spec)
        self._pools: dict[int, futures.ProcessPoolExecutor] = {}
        self._calls: dict[int, list[futures.Future]] = {}  # per slot, those not done when last seen

    def start(self, slots: list[int]) -> dict[int, Any]:
        handles = {}
        for slot in slots:
            self._pools[slot] = new_pool(REPLICA_PRELOAD)
            share = self.num_replicas
            load = (self.factory, self.spec, share, os.getpid())
            handles[slot] = self._call(slot, _host_load, *load)
        return handles

    def run_block(self, slot: int, block: Block) -> Any:
        return self._call(slot, _host_run_block, block)

    def finish(self, slot: int) -> Any:
        return self._call(slot, _host_finish)

    def _call(self, slot: int, function, *arguments) -> futures.Future:
        calls = [c for c in self._calls.get(slot, ()) if not c.done()]
        calls.append(self._pools[slot].submit(function, *arguments))
        self._calls[slot] = calls
        return calls[-1]

    def wait(self, handles: list, timeout_s: float, *, every: bool = False) -> list:
        when = futures.ALL_COMPLETED if every else futures.FIRST_COMPLETED
        done, _ = futures.wait(handles, timeout_s, return_when=when)
        return list(done)

    def result(self, handle: futures.Future) -> Any:
        try:
            return handle.result()
        except BrokenProcessPool:
            raise ReplicaDied(PROCESS_DIED) from None
        except Exception as error:
            raise ReplicaDied(failure_reason(error)) from None

    def stop(self, slot: int) -> None:
        pool = self._pools.pop(slot, None)
        if pool is not None:
            kill_pool(pool)

    def close(self) -> None:
        """Each replica's process: let go where idle (its queues then cleaned up), else killed."""
        for slot, pool in list(self._pools.items()):
            if any(not call.done() for call in self._calls.get(slot, ())):
                self.stop(slot)
            else:
                pool.shutdown(wait=True)
        self._pools.clear()


def failure_reason(error: BaseException) -> str:
    """How a replica's call failed, in one line: a ReplicaStartError's own words (they name the
    node), else the exception's type and message. Pure."""
    text = str(error) if isinstance(error, ReplicaStartError) else exception_text(error)
    return text.splitlines()[0] if text else type(error).__name__
