"""The finish step as it was written in the worker (``Worker._forward_and_sample`` and
``engine/stopping.py``), moved as is: the legacy path, mutating the requests in place. It stays
as the oracle compare mode shadows the planner with, imported only when a path named legacy is
built (``ops.finish_path``)."""

from __future__ import annotations

from collections.abc import Container, Sequence

from batchgen.state import Phase, RequestState, TokenLogprobs, WorkerState

# finish_reason of a request that sampled one of its stop token ids
STOP_REASON = "stop"


def finish_reason(req: RequestState, token: int, eos_ids: Container[int]) -> str | None:
    """Why ``req`` ends now that ``token`` was appended to its outputs, or None when it goes on:
    ``length`` at ``max_new_tokens``, ``stop`` for a stop token id, ``eos`` for an EOS id (unless
    ``ignore_eos``); neither stops it before ``min_tokens`` (the sampler masks them there). Pure."""
    request = req.request
    params = request.sampling
    num_outputs = len(req.output_ids)
    if num_outputs >= request.max_new_tokens:
        return "length"
    if num_outputs <= params.min_tokens - 1:
        return None
    if token in params.stop_token_ids:
        return STOP_REASON
    if token in eos_ids and not params.ignore_eos:
        return "eos"
    return None


class LegacyFinish:
    """The finish step over ``state``, in place."""

    def __init__(self, state: WorkerState):
        self.state = state

    def finish(
        self,
        served: Sequence[str],
        sampled: Sequence[tuple[int, TokenLogprobs]],
        eos_ids: Sequence[int],
    ) -> None:
        """Append each served request's sampled token and end those it ends. Mutates the served
        requests (outputs, first token step, phase, finish reason) and the stats."""
        reqs = [self.state.requests[uuid] for uuid in served]
        for req, (token, logprobs) in zip(reqs, sampled):
            req.append_token(token, logprobs)
            if req.first_token_step is None:
                req.first_token_step = self.state.step
            self.state.stats.tokens_generated += 1
            reason = finish_reason(req, token, eos_ids)
            if reason is not None:
                req.phase, req.finish_reason = Phase.FINISHED, reason
