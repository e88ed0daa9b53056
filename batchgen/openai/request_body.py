"""The body of one OpenAI batch line, checked: ``/v1/completions`` and ``/v1/chat/completions``
fields (OpenAI's, with vLLM's ``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``), and their mapping onto ``Sampling``.

A problem is a ``BodyError`` (status 400 naming the field and what is allowed, 404 for another
model): that line's error, never the job's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from batchgen.sampling_params import MAX_LOGPROBS
from batchgen.text.generation_defaults import GenerationDefaults
from batchgen.text.sampling import Sampling

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT)
MAX_N = 128
MAX_STOPS = 4  # as OpenAI allows
MAX_SHOWN = 80  # characters of a bad value quoted in its error
NO_DEFAULTS = GenerationDefaults()


class BodyError(ValueError):
    """A body this job cannot serve: ``status`` (400, 404), ``param`` (the field, or None)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class _Body(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None  # accepted, unused
    stream: Literal[False] = False  # a batch line's result is one response
    top_k: int = Field(default=0, ge=0)  # vLLM's extras from here on
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's completions default
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str
    name: str | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # None: the rest of the context
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


BODIES = {COMPLETIONS: CompletionBody, CHAT: ChatBody}


def parse_body(url: str, body: object, served_model: str) -> CompletionBody | ChatBody:
    """``body`` checked for ``url``; BodyError naming the field and what is allowed (400), or the
    model this job does not serve (404). Pure."""
    if url not in BODIES:
        raise BodyError(400, f"url {url!r} is not served; allowed: {', '.join(ENDPOINTS)}", "url")
    if not isinstance(body, dict):
        raise BodyError(400, f"body must be a JSON object, not {type(body).__name__}", "body")
    model = BODIES[url]
    unknown = sorted(set(body) - set(model.model_fields))
    if unknown:
        raise BodyError(
            400,
            f"unknown field {unknown[0]!r} for {url}; allowed: {', '.join(model.model_fields)}",
            unknown[0],
        )
    try:
        parsed = model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        got = repr(first["input"])
        got = got if len(got) <= MAX_SHOWN else got[: MAX_SHOWN - 3] + "..."
        raise BodyError(400, f"{field}: {first['msg']} (got {got})", field) from None
    if parsed.model is not None and parsed.model != served_model:
        raise BodyError(
            404, f"the model {parsed.model!r} does not exist; this job serves {served_model!r}"
        )
    _check_combinations(parsed)
    return parsed


def _check_combinations(body: CompletionBody | ChatBody) -> None:
    """BodyError (400) for fields valid alone that do not go together. Pure."""
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > MAX_STOPS or not all(stops):
        raise BodyError(400, f"stop: at most {MAX_STOPS} non-empty strings", "stop")
    if isinstance(body, ChatBody) and body.top_logprobs is not None and not body.logprobs:
        raise BodyError(400, "top_logprobs: needs logprobs true", "top_logprobs")
    limit = max_tokens(body)
    if limit is not None and body.min_tokens > limit:
        raise BodyError(400, f"min_tokens: must be at most max_tokens ({limit})", "min_tokens")


def max_tokens(body: CompletionBody | ChatBody) -> int | None:
    """The body's token limit: chat's ``max_completion_tokens`` over ``max_tokens``. Pure."""
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def sampling_of(
    body: CompletionBody | ChatBody, seed: int, defaults: GenerationDefaults = NO_DEFAULTS
) -> Sampling:
    """The ``Sampling`` ``body`` asks for; ``seed`` when it names none; the checkpoint's
    ``defaults`` for the sampling fields it does not set, and their ``max_new_tokens`` as a cap.
    Pure."""
    if isinstance(body, ChatBody):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    unset = {k: v for k, v in defaults.sampling.items() if k not in body.model_fields_set}
    limit = defaults.capped(max_tokens(body))
    return Sampling(
        n=body.n,
        max_tokens=limit,
        temperature=unset.get("temperature", body.temperature),
        top_p=unset.get("top_p", body.top_p),
        top_k=unset.get("top_k", body.top_k),
        min_p=unset.get("min_p", body.min_p),
        seed=body.seed if body.seed is not None else seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        min_tokens=body.min_tokens if limit is None else min(body.min_tokens, limit),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )
