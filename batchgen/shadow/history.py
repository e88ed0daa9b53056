"""What compare mode remembers of a run's compared ops: the history interactions are named by.

An interaction (``batchgen.shadow.interactions``) may depend on what came before the op: a
victim whose load landed a step ago, a load of a request recomputed before, pages a release
freed earlier in the same step. Neither KV path keeps such facts (they are not policy state, and
a field either path wrote would change what compare mode compares), so compare mode keeps them
here, per run, updated after each compared op from what it already holds: the op request, the
plan, and the requests the op wrote as they were before it (:meth:`RunHistory.record`).

The history is complete only when every op of every step is compared (sample 1.0, every op:
what ``batchgen validate`` runs); at a lower sample an interaction that needs a history may go
unnamed, never misnamed as another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from batchgen.kv.plans import Destination, PollAction
from batchgen.state import RequestState


@dataclass(slots=True)
class StepRecord:
    """What the compared ops of one step did so far, for the interactions across ops."""

    step: int
    evicted_to_host: set[str] = field(default_factory=set)  # victims stored to host
    released_gpu_page_ids: set[int] = field(default_factory=set)  # freed by release


@dataclass(slots=True)
class RunHistory:
    """One run's history of compared ops. Mutated only by :meth:`record` and
    :meth:`note_abort_of_done`; the interaction classifier only reads it."""

    step: StepRecord = field(default_factory=lambda: StepRecord(-1))
    load_landed_steps: dict[str, int] = field(default_factory=dict)  # uuid -> last step it landed
    recomputed: set[str] = field(default_factory=set)  # dropped for recompute at least once
    aborted_done: set[str] = field(default_factory=set)  # an abort landed after it was done

    def this_step(self, step: int) -> StepRecord:
        """The record of ``step``: empty when no compared op of it was recorded yet. Pure."""
        return self.step if self.step.step == step else StepRecord(step)

    def note_abort_of_done(self, uuid: str) -> None:
        """An abort landed on ``uuid`` after it finished or failed (the worker ignores it).
        Mutates ``aborted_done``."""
        self.aborted_done.add(uuid)

    def record(self, op: str, request, plan, written: Mapping[str, RequestState] | None) -> None:
        """Take in one compared op: its op request and plan (the plan path's), and the requests
        it wrote, each as it was before (``written``). Mutates self."""
        if op in ("migrate", "alloc"):  # they leave nothing a later interaction reads
            return
        step = request.snapshot.step
        self.step = self.this_step(step)
        if op == "poll":
            for uuid, action in zip(plan.uuids, plan.actions):
                if action is PollAction.COMPLETE:
                    self.load_landed_steps[uuid] = step
                elif action is PollAction.RECOMPUTE:
                    self.recomputed.add(uuid)
        elif op == "release":
            for uuid in request.uuids:
                self.step.released_gpu_page_ids.update((written or {})[uuid].gpu_page_ids)
                self.load_landed_steps.pop(uuid, None)
                self.recomputed.discard(uuid)
                self.aborted_done.discard(uuid)
        elif op == "evict":
            for victim in plan.victims:
                if victim.destination is Destination.HOST:
                    self.step.evicted_to_host.add(victim.uuid)
                else:
                    self.recomputed.add(victim.uuid)
