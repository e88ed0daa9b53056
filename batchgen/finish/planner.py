"""The finish step's stateless planner: from a frozen ``FinishRequest`` to a ``FinishPlan``.

Why a request ends after it sampled ``token`` (n: its outputs with ``token``), first match wins::

    n >= max_new_tokens                        length    finish.length
    n < min_tokens                             goes on   finish.before_min_tokens
    token in stop_token_ids                    stop      finish.stop
    token in eos_ids and not ignore_eos        eos       finish.eos
    otherwise                                  goes on   finish.goes_on

Before ``min_tokens`` the sampler masks stop token ids and EOS out, so only a request whose
``min_tokens`` exceeds what it may sample at all reaches ``finish.before_min_tokens`` with one.
"""

from __future__ import annotations

from batchgen.finish.plans import (
    EOS_REASON,
    LENGTH_REASON,
    STOP_REASON,
    FinishPlan,
    FinishRequest,
    SampledRequest,
    TokenFinish,
)


def plan_finish(request: FinishRequest) -> FinishPlan:
    """Each served request's token to append and its finish reason, in batch order. Pure."""
    return FinishPlan(
        tuple(
            TokenFinish(r.uuid, r.token, r.logprobs, finish_reason_of(r, request.eos_ids))
            for r in request.requests
        )
    )


def finish_reason_of(sampled: SampledRequest, eos_ids: tuple[int, ...]) -> str | None:
    """Why ``sampled`` ends once its token is appended, or None when it goes on. Pure."""
    num_outputs = sampled.num_outputs + 1
    if num_outputs >= sampled.max_new_tokens:
        return LENGTH_REASON  # decision: finish.length (before any stop: its last allowed token)
    if num_outputs < sampled.min_tokens:
        return None  # decision: finish.before_min_tokens
    if sampled.token in sampled.stop_token_ids:
        return STOP_REASON  # decision: finish.stop
    if sampled.token in eos_ids and not sampled.ignore_eos:
        return EOS_REASON  # decision: finish.eos
    return None  # decision: finish.goes_on
