"""The seam between the worker and its finish step: what the worker calls each step, and what the
edge hands it to build it.

    FinishOps      ``finish``: the plan path (``plan_path``), the legacy path (``legacy``) and
                   compare mode (``shadow``) each have it
    FinishSetup    the finish step the worker runs, and compare mode's runs of it when on
    FinishFactory  state -> FinishSetup: the worker calls it once, over its own state

The worker takes a factory (``Worker(finish_ops=...)``); the edge builds one from a parsed gate
(``batchgen.finish.shadow.finish_ops_for``). Without one the worker runs the plan path, nothing
watching.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from batchgen.finish.plan_path import PlanFinish
from batchgen.state import TokenLogprobs, WorkerState

FINISH_PATHS = ("plan", "legacy")


class FinishOps(Protocol):
    """The finish step over the state it was built with: mutates the served requests and the
    stats."""

    def finish(
        self,
        served: Sequence[str],
        sampled: Sequence[tuple[int, TokenLogprobs]],
        eos_ids: Sequence[int],
    ) -> None: ...


class FinishSetup(NamedTuple):
    """What a worker's finish step is: its ops, and what watches them."""

    ops: FinishOps
    compare: Any = None  # compare mode, when on (``batchgen.finish.shadow.FinishCompare``)


FinishFactory = Callable[[WorkerState], FinishSetup]


def finish_path(name: str, state: WorkerState) -> FinishOps:
    """The finish path ``name`` over ``state``; the legacy module is imported only here.
    ValueError naming the allowed paths for another name."""
    if name == "plan":
        return PlanFinish(state)
    if name == "legacy":
        from batchgen.finish.legacy import LegacyFinish

        return LegacyFinish(state)
    raise ValueError(f"unknown finish path {name!r}; allowed: {', '.join(FINISH_PATHS)}")


def plan_finish_ops(state: WorkerState) -> FinishSetup:
    """The plan path over ``state``, nothing watching: a worker's finish step by default. Pure."""
    return FinishSetup(PlanFinish(state))
