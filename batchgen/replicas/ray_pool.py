"""Replicas as Ray actors, on a local Ray instance or a cluster (``pools`` has the interface)."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

from batchgen.replicas.pools import ReplicaDied, ReplicaHost, ReplicaPool, failure_reason
from batchgen.replicas.replica import Block
from batchgen.sweep.backend_base import BackendError
from batchgen.sweep.ray_backend import import_ray, start_ray

PLACEMENT_TIMEOUT_S = 300.0  # the longest a replica may wait for the cluster to place it
ACTOR_DIED = "its process died (killed, out of memory or crashed) or its node was lost"


class RayReplicas(ReplicaPool):
    """Each replica a Ray actor of ``threads`` CPUs (and a GPU on ``cuda``), on the cluster at
    ``address`` or on a local instance of ``num_cpus`` CPUs started here. BackendError when Ray
    is missing or cannot start, or the cluster has fewer CPUs than the replicas need. A dead
    actor is not restarted by Ray: the driver starts another."""

    def __init__(self, num_replicas, factory, spec, *, address, num_cpus, threads, device):
        super().__init__(num_replicas, factory, spec)
        self._ray = import_ray()
        self._owns_instance = start_ray(address, num_cpus)
        try:
            _check_cpus(self._ray, num_replicas, threads, address)
        except BackendError:
            self.close()
            raise
        self._host = self._ray.remote(ReplicaHost).options(
            num_cpus=threads, num_gpus=1 if device == "cuda" else 0, max_restarts=0
        )
        self._actors: dict[int, Any] = {}
        self._nodes: dict[int, str] = {}

    def start(self, slots: list[int]) -> dict[int, Any]:
        """Create the slots' actors, learn their nodes, then load each with its node's share; an
        actor the cluster did not place in PLACEMENT_TIMEOUT_S (or that died) fails its load."""
        for slot in slots:
            self._actors[slot] = self._host.remote()
        placed = {slot: self._actors[slot].node.remote() for slot in slots}
        self._ray.wait(list(placed.values()), num_returns=len(placed), timeout=PLACEMENT_TIMEOUT_S)
        for slot, handle in placed.items():
            with contextlib.suppress(Exception):  # not placed, or died: handled below
                self._nodes[slot] = self._ray.get(handle, timeout=0)
        shares = Counter(self._nodes.values())
        loads = {}
        for slot in slots:
            if slot not in self._nodes:
                self.stop(slot)
                loads[slot] = _NotStarted(
                    f"in {PLACEMENT_TIMEOUT_S:.0f} s Ray placed it on no node"
                )
                continue
            share = shares[self._nodes[slot]]
            loads[slot] = self._actors[slot].load.remote(self.factory, self.spec, share)
        return loads

    def run_block(self, slot: int, block: Block) -> Any:
        return self._actors[slot].run_block.remote(block)

    def finish(self, slot: int) -> Any:
        return self._actors[slot].finish.remote()

    def wait(self, handles: list, timeout_s: float, *, every: bool = False) -> list:
        failed = [h for h in handles if isinstance(h, _NotStarted)]
        handles = [h for h in handles if not isinstance(h, _NotStarted)]
        if failed or not handles:
            return failed + (self.wait(handles, 0, every=every) if handles else [])
        count = len(handles) if every else 1
        done, _ = self._ray.wait(handles, num_returns=count, timeout=timeout_s)
        if every or not done:
            return done
        done, _ = self._ray.wait(handles, num_returns=len(handles), timeout=0)  # all ended by now
        return done

    def result(self, handle) -> Any:
        if isinstance(handle, _NotStarted):
            raise ReplicaDied(handle.reason)
        exceptions = self._ray.exceptions
        try:
            return self._ray.get(handle)
        except exceptions.RayTaskError as error:  # the replica raised
            raise ReplicaDied(failure_reason(error.cause or error)) from None
        except exceptions.RayActorError:
            raise ReplicaDied(ACTOR_DIED) from None
        except exceptions.RayError as error:  # an object lost, out of memory, ...
            raise ReplicaDied(failure_reason(error)) from None

    def stop(self, slot: int) -> None:
        actor = self._actors.pop(slot, None)
        self._nodes.pop(slot, None)
        if actor is not None:
            with contextlib.suppress(Exception):  # an actor that died already
                self._ray.kill(actor, no_restart=True)

    def close(self) -> None:
        for slot in list(getattr(self, "_actors", {})):
            self.stop(slot)
        if self._owns_instance:
            self._ray.shutdown()


class _NotStarted:
    """The handle of a load that never reached an actor; its reason says why."""

    def __init__(self, reason: str):
        self.reason = reason


def _check_cpus(ray, num_replicas: int, threads: int, address: str | None) -> None:
    """BackendError when the cluster has fewer CPUs than ``num_replicas`` replicas of ``threads``
    CPUs each take. Pure."""
    cpus = int(ray.cluster_resources().get("CPU", 0))
    if num_replicas * threads > cpus:
        where = f"the cluster at {address}" if address else "the local Ray instance"
        raise BackendError(
            f"--replicas {num_replicas} of --threads {threads} need {num_replicas * threads} CPUs;"
            f" {where} has {cpus}" + ("" if address else " (--num-cpus)")
        )
