"""What the finish step's planner reads and returns: immutable, built fresh every step. A step's
request and plan are frozen, slotted dataclasses; their per-request records are NamedTuples, a
third of a frozen dataclass's cost to build (a step builds two per served request).

    FinishRequest  the model's EOS ids and, per served request in batch order, the token it
                   sampled and what its ending depends on (``SampledRequest``)
    FinishPlan     per served request, in the same order: the token to append and why the
                   request ends now (None: it goes on: ``TokenFinish``)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from batchgen.state import TokenLogprobs

# finish reasons a plan names (an abort's, "abort", is set by Worker.abort, never planned)
LENGTH_REASON = "length"
STOP_REASON = "stop"
EOS_REASON = "eos"


class SampledRequest(NamedTuple):
    """One served request as the planner reads it."""

    uuid: str
    token: int  # the token its row sampled this step
    logprobs: TokenLogprobs  # appended with the token
    num_outputs: int  # output tokens before this one
    max_new_tokens: int
    min_tokens: int  # no stop token or EOS ends it before this many outputs
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool


@dataclass(frozen=True, slots=True)
class FinishRequest:
    eos_ids: tuple[int, ...]  # the model's
    requests: tuple[SampledRequest, ...]  # the step's served requests, in batch order


class TokenFinish(NamedTuple):
    """One request's part of a plan."""

    uuid: str
    token: int
    logprobs: TokenLogprobs
    finish_reason: str | None  # LENGTH_REASON, STOP_REASON, EOS_REASON; None: it goes on


@dataclass(frozen=True, slots=True)
class FinishPlan:
    tokens: tuple[TokenFinish, ...]  # in the request's order
