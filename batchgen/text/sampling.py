"""What a text prompt asks for: ``Sampling``, OpenAI's fields plus vLLM's common extras, and its
mapping onto the engine's ``Request`` (one per sample)."""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.sampling_params import SamplingParams
from batchgen.state import Request


@dataclass(frozen=True, slots=True)
class Sampling:
    """How to sample a prompt's completions; OpenAI's defaults (``max_tokens`` 16 is the
    completions endpoint's; None runs to the end of the context, as chat does)."""

    n: int = 1  # samples of the prompt, each its own random stream
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    min_p: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings: checked on the decoded text, excluded from it
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N: the sampled token's and the N most likely


def sample_uuid(key: str, index: int) -> str:
    """The engine uuid of sample ``index`` of prompt ``key``: the draws of a sample hash it, with
    the seed and position, so they depend on (seed, key, sample index, position) only. Pure."""
    return f"{key}/{index}"


def engine_requests(
    key: str,
    prompt_ids: tuple[int, ...],
    sampling: Sampling,
    *,
    eos_ids: tuple[int, ...],
    max_context: int,
) -> list[Request]:
    """The ``sampling.n`` engine requests of prompt ``key``: the checkpoint's ``eos_ids`` (its
    generation config's) join the stop token ids unless ``ignore_eos``; ``max_tokens`` None takes
    what is left of ``max_context`` after the prompt. Pure."""
    stop_ids = (*sampling.stop_token_ids, *(() if sampling.ignore_eos else eos_ids))
    params = SamplingParams(
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        min_tokens=sampling.min_tokens,
        ignore_eos=sampling.ignore_eos,
        stop_token_ids=tuple(dict.fromkeys(stop_ids)),
        num_logprobs=sampling.logprobs,
    )
    max_tokens = sampling.max_tokens
    if max_tokens is None:
        max_tokens = max(1, max_context - len(prompt_ids))
    return [
        Request(
            sample_uuid(key, index),
            prompt_ids,
            max_tokens,
            sampling.temperature,
            sampling.seed,
            params,
        )
        for index in range(sampling.n)
    ]
