"""The seam between the worker and its KV ops: what the worker calls each step, and what the edge
hands it to build them.

    KvOps      poll, release, evict, migrate, allocate: the plan path (``plan_path``), the legacy
               path (``legacy``) and compare mode (``batchgen.shadow.kv_compare``) each have them
    KvSetup    the ops the worker runs, and what watches them: compare mode's runs, the page-content
               oracle, and the gate they were built from
    KvFactory  target -> KvSetup: the worker calls it once, over its own target

The worker takes a factory (``Worker(kv_ops=...)``); the edge (the CLI, ``batchgen.LLM``,
validation) builds one from a parsed gate (``batchgen.shadow.wiring.kv_ops_for``). Without one
the worker runs the plan path, nothing watching.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

from batchgen.kv.gate import KvGateConfig
from batchgen.kv.plan_path import PlanKvPath
from batchgen.kv.target import KvTarget


class KvOps(Protocol):
    """A step's KV ops, in the order the worker runs them. Each mutates the target it was built
    over (the worker's state, pools and pending appends)."""

    def poll(self, observed: Mapping[str, str | None]) -> None: ...
    def release(self, uuids: Sequence[str]) -> None: ...
    def evict(self) -> None: ...
    def migrate(self) -> None: ...
    def allocate(self, batch: Sequence[str]) -> list[str]: ...


class PageOracle(Protocol):
    """The page-content oracle as the worker calls it (``batchgen.engine.kv_verify``)."""

    def check_loads(self) -> None: ...
    def appends(self) -> AbstractContextManager[None]: ...


class KvSetup(NamedTuple):
    """What a worker's KV side is: its ops and what watches them."""

    ops: KvOps
    gate: KvGateConfig  # the settings it was built from (its paths, its log)
    compare: Any = None  # compare mode, when on (``batchgen.shadow.kv_compare.KvCompare``)
    verifier: PageOracle | None = None  # the page-content oracle, when on


KvFactory = Callable[[KvTarget], KvSetup]


def plan_ops(target: KvTarget) -> KvSetup:
    """The plan path over ``target``, nothing watching: a worker's KV side by default. Pure."""
    return KvSetup(PlanKvPath(target), KvGateConfig())
