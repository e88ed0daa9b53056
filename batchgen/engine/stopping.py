"""When a request ends after a sampled token: the engine's finish reasons (token ids only; stop
strings are the edge's, checked on decoded text)."""

from __future__ import annotations

from collections.abc import Container

from batchgen.state import RequestState

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
