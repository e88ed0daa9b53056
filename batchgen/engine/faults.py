"""Seeded fault injection over the page pools and the worker.

A fault schedule is parsed from a SPEC string (``batchgen run --faults SPEC``)::

    seed=N                 schedule seed (default 0)
    load_fail=P            a load fails at once
    load_fail_late=P       a load fails 1-3 steps after it was issued
    load_hang=P            a load never completes (the worker times it out)
    slow_store=P           a GPU->host store is delayed by store_delay_ms
    store_delay_ms=X       the delay of a slow store, in [0, 10000] (default 2)
    host_shrink=P          per step: the host pool loses up to 1/4 of its free pages for 1-8 steps
    gpu_refuse=P           per step: the GPU pool refuses to hand out its free pages for one step
    abort=P                per step: abort one live request in a phase of abort_phases
    abort_phases=A+B       waiting, prefilling, decoding, swapped, loading (default: all)

Probabilities are in [0, 1], and load_fail + load_fail_late + load_hang <= 1 (a load
has one outcome). Faults are inputs: the worker observes them
before the KV ops run, so both KV paths (and compare mode) see the same ones.
Load outcomes depend only on (seed, request, its n-th load), per-step faults on
(seed, step): a schedule replays exactly.
"""

from __future__ import annotations

import math
import random
import time
import zlib
from dataclasses import dataclass, fields

from batchgen.kv.backends import HostKvPool
from batchgen.state import AsyncHandle, Phase, RequestState

# exclusive outcomes of one load, drawn in this order
LOAD_FAULTS = ("load_fail", "load_fail_late", "load_hang")
ABORT_PHASES = ("waiting", "prefilling", "decoding", "swapped", "loading")
OWNER_PREFIX = "fault:"  # pool owners of fault reservations; request uuids may not start with it
SHRINK_OWNER = OWNER_PREFIX + "host-shrink"
REFUSE_OWNER = OWNER_PREFIX + "gpu-refuse"


class FaultSpecError(ValueError):
    """A malformed ``--faults`` SPEC."""


class LoadFault(RuntimeError):
    """The injected failure of a host->GPU load."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    seed: int = 0
    load_fail: float = 0.0
    load_fail_late: float = 0.0
    load_hang: float = 0.0
    slow_store: float = 0.0
    store_delay_ms: float = 2.0
    host_shrink: float = 0.0
    gpu_refuse: float = 0.0
    abort: float = 0.0
    abort_phases: tuple[str, ...] = ABORT_PHASES

    @classmethod
    def parse(cls, spec: str) -> FaultSpec:
        """Parse ``key=value,...``; raises FaultSpecError naming the bad part."""
        names = {f.name for f in fields(cls)}
        values: dict[str, object] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, raw = part.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise FaultSpecError(
                    f"--faults: {part!r} is not KEY=VALUE with KEY one of"
                    f" {', '.join(sorted(names))}"
                )
            if key in values:
                raise FaultSpecError(f"--faults: {key} is given twice; give each KEY once")
            values[key] = cls._value(key, raw.strip())
        load_outcomes = math.fsum(values.get(key, 0.0) for key in LOAD_FAULTS)
        if load_outcomes > 1:
            raise FaultSpecError(
                f"--faults: {' + '.join(LOAD_FAULTS)} = {load_outcomes:g} must be at most 1 "
                "(they are exclusive outcomes of one load)"
            )
        return cls(**values)

    def to_spec(self) -> str:
        """The SPEC string that :meth:`parse` reads back to this spec (every key, defaults
        included)."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            parts.append(f"{f.name}={'+'.join(value) if isinstance(value, tuple) else value}")
        return ",".join(parts)

    @staticmethod
    def _value(key: str, raw: str) -> object:
        if key == "abort_phases":
            phases = tuple(p for p in raw.split("+") if p)
            bad = [p for p in phases if p not in ABORT_PHASES]
            if bad or not phases:
                raise FaultSpecError(
                    f"--faults: abort_phases={raw!r}; allowed: {'+'.join(ABORT_PHASES)}"
                )
            return phases
        try:
            value = int(raw) if key == "seed" else float(raw)
        except ValueError:
            kind = "an integer" if key == "seed" else "a number"
            raise FaultSpecError(f"--faults: {key}={raw!r} is not {kind}") from None
        if key == "store_delay_ms" and not 0 <= value <= 10_000:
            raise FaultSpecError(f"--faults: store_delay_ms={raw} must be in [0, 10000]")
        if key not in ("seed", "store_delay_ms") and not 0.0 <= value <= 1.0:
            raise FaultSpecError(f"--faults: {key}={raw} must be a probability in [0, 1]")
        return value


class FaultHandle:
    """Handle of a load under fault injection. ``may_stall``: the worker reads it
    only when done; ``wait()`` never blocks on an injected stall, it raises."""

    may_stall = True

    def __init__(self, outcome: str, ready_step: int, clock, inner: AsyncHandle | None):
        self._outcome, self._ready_step, self._clock, self._inner = (
            outcome,
            ready_step,
            clock,
            inner,
        )

    def done(self) -> bool:
        return self._outcome != "hang" and self._clock() >= self._ready_step

    def wait(self) -> None:
        if self._outcome == "ok":
            self._inner.wait()
        elif self._outcome == "hang" or not self.done():
            raise LoadFault("injected stall: the load has not completed")
        else:
            raise LoadFault(f"injected {self._outcome.replace('_', ' ')}")


class FaultyHostKvPool(HostKvPool):
    """A host pool whose loads and stores follow the fault schedule. Forks are plain."""

    def __init__(self, injector: FaultInjector, pool: HostKvPool):
        super().__init__(pool.num_pages, pool.tensor, pool.gpu, pages=pool.pages)
        self._injector = injector
        self._num_loads: dict[str, int] = {}

    def load_to_gpu_async(self, uuid: str, page_ids: list[int]) -> AsyncHandle:
        nth = self._num_loads.get(uuid, 0)
        self._num_loads[uuid] = nth + 1
        outcome, delay = self._injector.load_outcome(uuid, nth)
        # a failing load issues no copy
        inner = super().load_to_gpu_async(uuid, page_ids) if outcome == "ok" else None
        step = self._injector.step
        return FaultHandle(outcome, step + delay, lambda: self._injector.step, inner)

    def store_from_gpu(self, uuid: str, gpu_page_ids: list[int]) -> None:
        if self._injector.store_is_slow(uuid, gpu_page_ids):
            time.sleep(self._injector.spec.store_delay_ms / 1000)
        super().store_from_gpu(uuid, gpu_page_ids)


class FaultInjector:
    """Applies a :class:`FaultSpec` to one worker. Mutates the worker's pools and
    requests (reservations, aborts) in :meth:`before_step` only."""

    def __init__(self, spec: FaultSpec):
        self.spec = spec
        self.step = 0
        self._reservations: list[tuple[int, object, str]] = []  # (release step, pool, owner)
        self._num_reservations = 0
        self.num_aborts = 0

    def host_pool(self, pool: HostKvPool) -> FaultyHostKvPool:
        return FaultyHostKvPool(self, pool)

    def _draw(self, *key: object) -> random.Random:
        return random.Random(zlib.crc32(repr((self.spec.seed, *key)).encode()))

    def load_outcome(self, uuid: str, nth: int) -> tuple[str, int]:
        """(outcome, steps until it is observable) of ``uuid``'s ``nth`` load. Pure."""
        rng, spec = self._draw("load", uuid, nth), self.spec
        roll = rng.random()
        for outcome, p in (
            ("load_fail", spec.load_fail),
            ("load_fail_late", spec.load_fail_late),
            ("hang", spec.load_hang),
        ):
            if roll < p:
                return outcome, rng.randint(1, 3) if outcome == "load_fail_late" else 1
            roll -= p
        return "ok", 1

    def store_is_slow(self, uuid: str, page_ids: list[int]) -> bool:
        return self._draw("store", uuid, tuple(page_ids)).random() < self.spec.slow_store

    def owner_ids(self) -> set[str]:
        """Pseudo-owners of reserved pages (live for integrity checks)."""
        return {owner for _, _, owner in self._reservations}

    def has_reservations(self) -> bool:
        return bool(self._reservations)

    def before_step(self, worker) -> None:
        """Apply this step's faults to ``worker``: expire and make reservations, abort.

        Makes nothing new when the worker has no live request, so a run drains.
        """
        self.step = worker.state.step
        for item in [r for r in self._reservations if r[0] <= self.step]:
            item[1].release_pages(item[2])
            self._reservations.remove(item)
        if not worker.state.requests:
            return
        rng, spec = self._draw("step", self.step), self.spec
        if rng.random() < spec.host_shrink:
            self._reserve(
                worker.host_kv,
                SHRINK_OWNER,
                worker.host_kv.free_pages() // 4,
                self.step + rng.randint(1, 8),
            )
        if rng.random() < spec.gpu_refuse:
            self._reserve(worker.gpu_kv, REFUSE_OWNER, worker.gpu_kv.free_pages(), self.step + 1)
        if rng.random() < spec.abort:
            self._abort_one(worker, rng)

    def _reserve(self, pool, owner: str, num_pages: int, until: int) -> None:
        if num_pages <= 0:
            return
        self._num_reservations += 1
        owner = f"{owner}:{self._num_reservations}"
        pool.allocate_pages(owner, num_pages)
        self._reservations.append((until, pool, owner))

    def _abort_one(self, worker, rng: random.Random) -> None:
        phase = rng.choice(self.spec.abort_phases)
        candidates = [r for r in worker.state.requests.values() if abort_phase(r) == phase]
        if candidates:
            worker.abort(rng.choice(candidates).uuid)
            self.num_aborts += 1


def abort_phase(req: RequestState) -> str | None:
    """The fault-schedule phase name of a live request (None when already done)."""
    if req.phase is Phase.RUNNING:
        return "prefilling" if len(req.output_ids) <= 1 else "decoding"
    if req.phase in (Phase.WAITING, Phase.SWAPPED, Phase.LOADING):
        return req.phase.value
    return None
