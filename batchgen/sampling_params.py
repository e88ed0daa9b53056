"""A request's sampling parameters beyond ``Request``'s own ``temperature`` and ``seed``.

The defaults change nothing: a ``Request`` built without them samples, and ends, as before. The
edge (``batchgen.openai``, ``batchgen.llm``) maps OpenAI's fields onto these; the engine sees
token ids only (stop *strings* are checked at the edge, on the decoded text).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

MAX_LOGPROBS = 20  # as OpenAI allows


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it ends (with ``Request.max_new_tokens``)."""

    top_p: float = 1.0  # keep the most likely tokens whose probabilities first reach top_p
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one's probability
    min_tokens: int = 0  # EOS and stop token ids cannot be sampled before this many new tokens
    ignore_eos: bool = False  # EOS does not end the request (stop token ids still do)
    stop_token_ids: tuple[int, ...] = ()  # a sampled one ends the request ("stop")
    # None: no log-probabilities; N (0-20): the sampled token's and the N most likely ones'
    num_logprobs: int | None = None

    @property
    def is_filtered(self) -> bool:
        """Whether a mask (top-k, top-p, min-p) narrows the distribution sampled from."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


DEFAULT_SAMPLING = SamplingParams()


def sampling_problem(params: SamplingParams, max_new_tokens: int, vocab_size: int) -> str | None:
    """What is wrong with ``params`` for a request of ``max_new_tokens`` on a model of
    ``vocab_size`` tokens, naming the field and what is allowed; None when nothing is. Pure."""
    if not isinstance(params, SamplingParams):
        return f"sampling must be a SamplingParams, not {type(params).__name__}"
    real, integer = _is_real, _is_integer
    checks = (
        ("top_p", real(params.top_p) and 0.0 < params.top_p <= 1.0, "a number in (0, 1]"),
        ("top_k", integer(params.top_k) and params.top_k >= 0, "an int >= 0 (0 keeps all)"),
        ("min_p", real(params.min_p) and 0.0 <= params.min_p <= 1.0, "a number in [0, 1]"),
        (
            "min_tokens",
            integer(params.min_tokens) and 0 <= params.min_tokens <= max_new_tokens,
            f"an int in [0, max_new_tokens = {max_new_tokens}]",
        ),
        ("ignore_eos", isinstance(params.ignore_eos, bool), "true or false"),
        (
            "num_logprobs",
            params.num_logprobs is None
            or integer(params.num_logprobs)
            and 0 <= params.num_logprobs <= MAX_LOGPROBS,
            f"None or an int in [0, {MAX_LOGPROBS}]",
        ),
    )
    for name, ok, allowed in checks:
        if not ok:
            return f"{name}={getattr(params, name)!r}; must be {allowed}"
    ids = params.stop_token_ids
    if not isinstance(ids, tuple) or not all(integer(i) and 0 <= i < vocab_size for i in ids):
        return f"stop_token_ids={ids!r}; must be a tuple of token ids in [0, {vocab_size})"
    return None


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
