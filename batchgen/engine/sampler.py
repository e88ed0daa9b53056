"""Token sampling: greedy, or seeded multinomial that ignores batch composition.

A sampled request draws from a generator seeded by (request seed, uuid,
position), so its tokens do not depend on which other requests shared the step.
A temperature below ``GREEDY_BELOW`` samples greedily: dividing the logits by it
would overflow to infinity, and the distribution is one-hot long before.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from batchgen.engine.state import RequestState, TokenLogprobs

GREEDY_BELOW = 1e-5


def sample(logits: torch.Tensor, reqs: Sequence[RequestState]) -> list[tuple[int, TokenLogprobs]]:
    """One token per row of ``logits`` [num_reqs, vocab]; pure."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, k=2, dim=-1)
    top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    out = []
    for row, req in enumerate(reqs):
        temperature = req.request.temperature
        if temperature < GREEDY_BELOW:
            token = top_ids[row][0]
        else:
            key = f"{req.request.seed}:{req.uuid}:{req.num_tokens}".encode()
            gen = torch.Generator().manual_seed(zlib.crc32(key))
            probs = torch.softmax(logits[row].float().cpu() / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        out.append((token, TokenLogprobs(tuple(top_ids[row]), tuple(top_lps[row]))))
    return out
