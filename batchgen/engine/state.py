"""The request types, where ``batchgen.text`` and ``batchgen.openai`` import them from: they live
in ``batchgen.state``, below the KV layer that mutates them."""

from batchgen.state import Phase, Request, RequestOutput, TokenLogprobs

__all__ = ["Phase", "Request", "RequestOutput", "TokenLogprobs"]
