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
import torch.nn.functional as F

from batchgen.engine.state import RequestState, TokenLogprobs

GREEDY_BELOW = 1e-5
# Logits per block of the top-2 search; a max over blocks is a vectorised reduction, torch.topk over
# a whole vocabulary is not.
TOP2_BLOCK = 64


def sample(logits: torch.Tensor, reqs: Sequence[RequestState]) -> list[tuple[int, TokenLogprobs]]:
    """One token per row of ``logits`` [num_reqs, vocab]; pure."""
    logits = logits.float()
    top_logits, top_ids = top2(logits)
    top_lps = (top_logits - log_normaliser(logits, top_logits[:, :1])).tolist()
    top_ids = top_ids.tolist()
    out = []
    for row, req in enumerate(reqs):
        temperature = req.request.temperature
        if temperature < GREEDY_BELOW:
            token = top_ids[row][0]
        else:
            key = f"{req.request.seed}:{req.uuid}:{req.num_tokens}".encode()
            gen = torch.Generator().manual_seed(zlib.crc32(key))
            probs = torch.softmax(logits[row].cpu() / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        out.append((token, TokenLogprobs(tuple(top_ids[row]), tuple(top_lps[row]))))
    return out


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two largest logits of each row of ``logits`` [rows, vocab >= 2] and their ids, largest
    first, each [rows, 2]. Pure.

    Both lie in the two blocks of ``TOP2_BLOCK`` logits with the largest maxima, so only those two
    blocks are searched.
    """
    num_rows, vocab_size = logits.shape
    if vocab_size <= 2 * TOP2_BLOCK:
        top = logits.topk(2, dim=-1)
        return top.values, top.indices
    padded = logits
    if vocab_size % TOP2_BLOCK:
        padded = F.pad(logits, (0, -vocab_size % TOP2_BLOCK), value=-torch.inf)
    blocks = padded.view(num_rows, -1, TOP2_BLOCK)
    top_blocks = blocks.amax(dim=-1).topk(2, dim=-1).indices  # [rows, 2]
    candidate_ids = (
        top_blocks[:, :, None] * TOP2_BLOCK + torch.arange(TOP2_BLOCK, device=logits.device)
    ).view(num_rows, -1)
    top = padded.gather(1, candidate_ids).topk(2, dim=-1)
    return top.values, candidate_ids.gather(1, top.indices)


def log_normaliser(logits: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` [rows, 1] of each row of ``logits`` [rows, vocab] whose max is ``row_max``
    [rows, 1]. Pure."""
    return (logits - row_max).exp_().sum(dim=-1, keepdim=True).log_() + row_max
