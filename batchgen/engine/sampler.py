"""Token sampling, batched: greedy rows by one argmax, sampled rows by one masked inverse-CDF draw.

Every step samples all its rows at once: greedy rows (temperature below ``GREEDY_BELOW``) take the
argmax the top-2 search already found; sampled rows are divided by their temperatures, narrowed by
their top-k, min-p and top-p masks, and each picks the token where its cumulative probability
reaches its own uniform draw ``u``. ``u`` is a hash of the request's (seed, uuid, position)
(``draw_key``; an edge that runs n samples of one prompt gives each its own uuid), so a row's token
depends on its own logits and nothing else in the batch. The only per-row Python left is reading
each request's parameters and hashing its key: a uuid is a string, and no tensor op hashes one.
On a CPU the top-2 search and the log-normaliser are one numba kernel (``sampler_kernel``).

A temperature below ``GREEDY_BELOW`` samples greedily: dividing the logits by it would overflow to
infinity, and the distribution is one-hot long before. Before ``min_tokens`` new tokens, EOS (unless
``ignore_eos``) and the stop token ids are masked out, greedy rows included. Reported
log-probabilities are of the model's distribution, before temperature and masks.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from batchgen.sampling_params import DEFAULT_SAMPLING, SamplingParams
from batchgen.state import RequestState, TokenLogprobs

GREEDY_BELOW = 1e-5
# Logits per block of the top-2 search; a max over blocks is a vectorised reduction, torch.topk over
# a whole vocabulary is not.
TOP2_BLOCK = 64
_DRAW_BITS = 53  # a float64 holds 53 bits exactly


def sample(
    logits: torch.Tensor, reqs: Sequence[RequestState], eos_ids: Sequence[int] = ()
) -> list[tuple[int, TokenLogprobs]]:
    """One token per row of ``logits`` [num_reqs, vocab] for ``reqs`` (``eos_ids``: the model's
    EOS ids, masked out before ``min_tokens``); pure."""
    logits = logits.float()
    top_logits, top_ids, normaliser = top2_and_normaliser(logits)
    top_lps = (top_logits - normaliser).tolist()
    sampled_rows = [row for row, r in enumerate(reqs) if r.request.temperature >= GREEDY_BELOW]
    special = [row for row, r in enumerate(reqs) if r.request.sampling is not DEFAULT_SAMPLING]
    masked = _mask_stops_before_min_tokens(logits, [reqs[row] for row in special], special, eos_ids)
    if masked is logits and not sampled_rows:  # all greedy, nothing masked: the top-2's argmax
        chosen, top_ids = top_ids[:, 0], top_ids.tolist()
        tokens = [ids[0] for ids in top_ids]
    else:
        chosen = masked.argmax(dim=-1) if masked is not logits else top_ids[:, 0].clone()
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            chosen[rows] = draw(masked[rows], [reqs[row] for row in sampled_rows])
        tokens, top_ids = chosen.tolist(), top_ids.tolist()
    sampled = [
        (token, TokenLogprobs(tuple(top_ids[row]), tuple(top_lps[row])))
        for row, token in enumerate(tokens)
    ]
    for row, extra in _requested_logprobs(logits, normaliser, chosen, reqs, special).items():
        token, lp = sampled[row]
        sampled[row] = (token, TokenLogprobs(lp.top_ids, lp.top_logprobs, *extra))
    return sampled


def draw_key(req: RequestState) -> bytes:
    """What the uniform draw for ``req``'s next token hashes: its seed, uuid and position. Pure."""
    return f"{req.request.seed}:{req.uuid}:{req.num_tokens}".encode()


def uniform(key: bytes) -> float:
    """A number in (0, 1] fixed by ``key``: 53 bits of its BLAKE2b hash. Pure."""
    bits = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> (64 - _DRAW_BITS)
    return (bits + 1) / 2**_DRAW_BITS


def draw(logits: torch.Tensor, reqs: Sequence[RequestState]) -> torch.Tensor:
    """One token id per row of ``logits`` [rows, vocab] (masked already, -inf = excluded), sampled
    at each request's temperature under its masks with its own uniform draw; [rows]. Pure.

    The token is the first whose cumulative probability reaches ``u`` times the total (float64):
    with ``u`` in (0, 1] no token of probability 0 is ever the first to reach it.
    """
    params = [r.request.sampling for r in reqs]
    temperatures = torch.tensor([r.request.temperature for r in reqs], device=logits.device)
    scaled = logits / temperatures[:, None]
    if any(p.is_filtered for p in params):
        scaled = filter_logits(scaled, params)
    cdf = torch.softmax(scaled.double(), dim=-1).cumsum_(dim=-1)
    u = torch.tensor([uniform(draw_key(r)) for r in reqs], dtype=torch.float64, device=cdf.device)
    targets = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, targets).squeeze(1).clamp_(max=logits.shape[-1] - 1)


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` [rows, vocab] with the tokens each row's top-k, min-p and top-p masks drop set to
    -inf (in vLLM's order: top-k, then min-p, then top-p on what is left, renormalised). The most
    likely token always stays. Pure: a new tensor."""
    vocab = logits.shape[-1]
    device = logits.device
    values, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    keep = torch.arange(vocab, device=device)[None, :] < top_k[:, None]
    probs = torch.softmax(values.masked_fill(~keep, -torch.inf), dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    probs = torch.softmax(values.masked_fill(~keep, -torch.inf), dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    keep &= probs.cumsum(dim=-1) - probs < top_p[:, None]  # the mass before a token is below top_p
    keep[:, 0] = True
    return torch.empty_like(logits).scatter_(1, order, values.masked_fill(~keep, -torch.inf))


def _mask_stops_before_min_tokens(
    logits: torch.Tensor,
    reqs: Sequence[RequestState],
    rows: Sequence[int],
    eos_ids: Sequence[int],
) -> torch.Tensor:
    """``logits`` with the ids that would end a request (stop token ids; EOS unless ``ignore_eos``)
    at -inf in row ``rows[i]`` for each ``reqs[i]`` short of its ``min_tokens``; ``logits`` itself
    when no row is. Pure."""
    masked_rows, cols = [], []
    for row, req in zip(rows, reqs):
        params = req.request.sampling
        if len(req.output_ids) < params.min_tokens:
            ids = (*params.stop_token_ids, *(() if params.ignore_eos else eos_ids))
            masked_rows += [row] * len(ids)
            cols += ids
    if not masked_rows:
        return logits
    masked = logits.clone()
    masked[torch.tensor(masked_rows), torch.tensor(cols)] = -torch.inf
    return masked


def _requested_logprobs(
    logits: torch.Tensor,
    normaliser: torch.Tensor,
    chosen: torch.Tensor,
    reqs: Sequence[RequestState],
    rows: Sequence[int],
) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
    """Row -> (the sampled token's log-probability, the top N (id, log-probability)) for each of
    ``rows`` whose request asks for log-probabilities (``num_logprobs`` not None). Pure."""
    wanted = [(row, reqs[row].request.sampling.num_logprobs) for row in rows]
    wanted = [(row, n) for row, n in wanted if n is not None]
    if not wanted:
        return {}
    rows = torch.tensor([row for row, _ in wanted], device=logits.device)
    logprobs = logits[rows] - normaliser[rows]
    token_lps = logprobs.gather(1, chosen[rows, None]).squeeze(1).tolist()
    most = max(n for _, n in wanted)
    top = logprobs.topk(most, dim=-1) if most else None
    top_ids = top.indices.tolist() if top is not None else [[]] * len(wanted)
    top_lps = top.values.tolist() if top is not None else [[]] * len(wanted)
    return {
        row: (token_lps[i], tuple(zip(top_ids[i][:n], top_lps[i][:n])))
        for i, (row, n) in enumerate(wanted)
    }


def top2_and_normaliser(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``top2`` and ``log_normaliser`` of ``logits`` [rows, vocab >= 2] (float32): on a CPU as one
    call of ``sampler_kernel`` (the lower id first among equal logits, as argmax takes them);
    elsewhere, or where a row holds NaN or no finite maximum, as torch ops. Pure."""
    if logits.is_cpu:
        num_rows = logits.shape[0]
        values, ids = torch.empty(num_rows, 2), torch.empty(num_rows, 2, dtype=torch.int64)
        normaliser = torch.empty(num_rows)
        sampler_kernel().top2_and_normaliser(
            logits.numpy(), values.numpy(), ids.numpy(), normaliser.numpy()
        )
        if not np.isnan(normaliser.numpy()).any():
            return values, ids, normaliser[:, None]
    top_logits, top_ids = top2(logits)
    return top_logits, top_ids, log_normaliser(logits, top_logits[:, :1])


@functools.cache
def sampler_kernel():
    """The kernel module, imported at first use: numba loads only where a CPU samples. Cached: the
    import machinery would run again every step."""
    from batchgen.engine import sampler_kernel as kernels

    return kernels


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
