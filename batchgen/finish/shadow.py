"""Compare mode for the finish step: its binding to ``compare.Experiment``.

Per compared step (``compare.ShadowExecutor`` fixes the order)::

    fork           copies of the served requests (their output lists their own) and of the
                   stats: all a finish step writes (``fork_state``)
    shadow         the shadow path's finish step on the fork
    authoritative  the authoritative path's on the worker's state
    canonicalize   both sides as ``step_form``: per served request its output tail (the token
                   just appended), phase and finish reason; the tokens generated

A run is one workload: ``begin_run`` returns it, a ``compare.Experiment`` logging to this one
sink, which the runner closes with the workload (``close``, or its ``with`` block).
"""

from __future__ import annotations

from collections.abc import Sequence

from batchgen.finish.gate import FINISH_OP, FinishGateConfig
from batchgen.finish.ops import FinishFactory, FinishSetup, finish_path
from batchgen.state import WorkerState
from compare import Experiment, JsonlSink, Keyed


class FinishCompare:
    """The finish step on the gate's path, shadowed by the other one (or ``shadow_path``: the
    same one is the A/A noise check) on forks. Mutates the state it was built over (through its
    authoritative path) and the log."""

    def __init__(self, state: WorkerState, gate: FinishGateConfig, shadow_path: str | None = None):
        self.state, self.gate, self.sink = state, gate, JsonlSink(gate.compare_log)
        self.paths = (gate.path, shadow_path or gate.shadow_path)
        self.authoritative = finish_path(gate.path, state)
        self.served, self.fork = (), None  # the step being compared, and its fork
        self.begin_run("unnamed", seed=0)

    def begin_run(self, workload: str, **run) -> Experiment:
        """Start a run of ``workload`` (``run``: its ``seed``, its ``run_id``) and return it: its
        ``close`` (or its ``with`` block) logs its summary. Mutates self."""
        self.experiment = Experiment.from_gate(
            FINISH_OP, self.gate, paths=self.paths, log=self.sink, workload=workload, **run,
            fork=self._fork, canonicalize=self._forms,
        )  # fmt: skip
        return self.experiment

    def finish(self, served: Sequence[str], sampled: Sequence, eos_ids: Sequence[int]) -> None:
        """The authoritative path's finish step, and the shadow path's on a fork when the run
        samples the step, compared. Mutates what the authoritative path mutates."""
        self.served, args = served, (served, sampled, eos_ids)
        self.experiment.run(
            FINISH_OP, self.state.step, authoritative=lambda: self.authoritative.finish(*args),
            shadow=lambda fork: finish_path(self.paths[1], fork).finish(*args),
        )  # fmt: skip

    def _fork(self) -> WorkerState:
        self.fork = fork_state(self.state, self.served)
        return self.fork

    def _forms(self, authoritative, shadow) -> tuple[dict, dict]:
        return step_form(self.state, self.served), step_form(self.fork, self.served)


def fork_state(state: WorkerState, served: Sequence[str]) -> WorkerState:
    """Copies of ``state``'s served requests (their output lists their own) and of its stats, at
    its step: all a finish step writes. Pure."""
    forks = {uuid: state.requests[uuid].copy() for uuid in served}
    for req in forks.values():
        req.output_ids, req.output_logprobs = list(req.output_ids), list(req.output_logprobs)
    return WorkerState(step=state.step, requests=forks, stats=state.stats.copy())


def step_form(state: WorkerState, served: Sequence[str]) -> dict:
    """What a finish step left, comparable: per served request (``requests[<uuid>]``) its output
    tail, phase and finish reason; the tokens generated. Pure."""
    forms = Keyed()
    for uuid in served:
        req = state.requests[uuid]
        tail, phase, reason = req.output_ids[-1:], req.phase.name, req.finish_reason
        forms[uuid] = {"output_tail": tail, "phase": phase, "finish_reason": reason}
    return {"requests": forms, "tokens_generated": state.stats.tokens_generated}


def finish_ops_for(gate: FinishGateConfig, *, shadow_path: str | None = None) -> FinishFactory:
    """What a worker's finish step is under ``gate``: its path, or compare mode (``shadow_path``
    overrides the shadowed path). Pure."""

    def build(state: WorkerState) -> FinishSetup:
        compare = None if gate.compare == "off" else FinishCompare(state, gate, shadow_path)
        return FinishSetup(compare or finish_path(gate.path, state), compare)

    return build
