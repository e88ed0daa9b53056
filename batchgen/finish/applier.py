"""The plan path's one writer: a ``FinishPlan`` applied to the worker's state."""

from __future__ import annotations

from batchgen.finish.plans import FinishPlan
from batchgen.state import Phase, WorkerState


def apply_finish(state: WorkerState, plan: FinishPlan) -> None:
    """Append each planned token to its request (noting the step of its first), count it, and
    end the requests the plan ends: FINISHED with their reason. Mutates the planned requests
    (outputs, first token step, phase, finish reason) and ``state.stats.tokens_generated``."""
    for planned in plan.tokens:
        req = state.requests[planned.uuid]
        req.append_token(planned.token, planned.logprobs)
        if req.first_token_step is None:
            req.first_token_step = state.step
        state.stats.tokens_generated += 1
        if planned.finish_reason is not None:
            req.phase, req.finish_reason = Phase.FINISHED, planned.finish_reason
