"""The sampling parameters, where ``batchgen.text`` and ``batchgen.openai`` import them from: they
live in ``batchgen.sampling_params``, beside the request state that carries them."""

from batchgen.sampling_params import MAX_LOGPROBS, SamplingParams

__all__ = ["MAX_LOGPROBS", "SamplingParams"]
