"""The finish step's plan path: a frozen snapshot of the served requests, the planner's plan, and
the applier (the default path)."""

from __future__ import annotations

from collections.abc import Sequence

from batchgen.finish.applier import apply_finish
from batchgen.finish.planner import plan_finish
from batchgen.finish.plans import FinishRequest, SampledRequest
from batchgen.state import RequestState, TokenLogprobs, WorkerState


class PlanFinish:
    """The finish step over ``state``: snapshot, plan, apply."""

    def __init__(self, state: WorkerState):
        self.state = state

    def finish(
        self,
        served: Sequence[str],
        sampled: Sequence[tuple[int, TokenLogprobs]],
        eos_ids: Sequence[int],
    ) -> None:
        """Append each served request's sampled token and end those it ends. Mutates what
        ``apply_finish`` mutates."""
        apply_finish(self.state, plan_finish(finish_request(self.state, served, sampled, eos_ids)))


def finish_request(
    state: WorkerState,
    served: Sequence[str],
    sampled: Sequence[tuple[int, TokenLogprobs]],
    eos_ids: Sequence[int],
) -> FinishRequest:
    """What the planner reads of ``state``: each served request (by uuid, in batch order) with the
    (token, logprobs) its row sampled. Pure."""
    requests = tuple(
        _sampled(state.requests[uuid], token, logprobs)
        for uuid, (token, logprobs) in zip(served, sampled)
    )
    return FinishRequest(tuple(eos_ids), requests)


def _sampled(req: RequestState, token: int, logprobs: TokenLogprobs) -> SampledRequest:
    """``req`` frozen as the planner reads it, with the token it sampled. Pure."""
    request, params = req.request, req.request.sampling
    return SampledRequest(
        req.uuid,
        token,
        logprobs,
        len(req.output_ids),
        request.max_new_tokens,
        params.min_tokens,
        params.stop_token_ids,
        params.ignore_eos,
    )  # positional: a step builds one per served request
