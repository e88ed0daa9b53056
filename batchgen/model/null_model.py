"""A weightless stand-in for the model, for bookkeeping-only runs.

``NullModel`` has the model interface (``config``, ``forward(seqs, kv_pages)``)
but computes nothing: each sequence's next token is a cheap hash of its last
token id and that token's position, returned as a one-hot row of logits, so
greedy sampling is deterministic and independent of batch composition. It
returns no K/V (``new_kv`` is all ``None``), which a worker built with
``kv_storage=False`` accepts. Benchmarks use it to time KV bookkeeping alone;
equivalence tests use it to run many traces fast.

    token(last, pos) = (last * 1_000_003 + pos * 7_919 + 17) mod vocab_size
                       (+1 mod vocab_size while that is an EOS id)

Skipping EOS keeps every request running to ``max_new_tokens``, so a trace's
length depends only on its requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from batchgen.config import ModelConfig
from batchgen.model.llama import ForwardOutput, SeqInput


class NullModel:
    """Deterministic next-token oracle with no weights; pure (never touches ``kv_pages``)."""

    def __init__(self, config: ModelConfig):
        if config.vocab_size < 2:
            raise ValueError(
                f"NullModel needs vocab_size >= 2 (sampling takes a top-2), got {config.vocab_size}"
            )
        self._eos_ids = frozenset(config.eos_token_ids)
        if self._eos_ids.issuperset(range(config.vocab_size)):
            raise ValueError(
                "NullModel needs a token that is not EOS, but every id of the vocabulary "
                f"({config.vocab_size}) is one"
            )
        self.config = config

    def next_token(self, last_token_id: int, position: int) -> int:
        """The token greedy sampling picks after ``last_token_id`` at ``position``."""
        vocab = self.config.vocab_size
        token = (last_token_id * 1_000_003 + position * 7_919 + 17) % vocab
        while token in self._eos_ids:  # EOS ids may be consecutive (Llama 3.1: 128008, 128009)
            token = (token + 1) % vocab
        return token

    def forward(self, seqs: Sequence[SeqInput], kv_pages: Tensor | None) -> ForwardOutput:
        """One-hot logits [num_seqs, vocab] float32 and ``None`` K/V per sequence."""
        if not seqs:
            raise ValueError("forward needs at least one sequence")
        tokens = []
        for index, seq in enumerate(seqs):
            if not seq.token_ids:
                raise ValueError(f"sequence {index} has no new tokens")
            tokens.append(
                self.next_token(seq.token_ids[-1], seq.start_pos + len(seq.token_ids) - 1)
            )
        logits = torch.zeros(len(seqs), self.config.vocab_size, dtype=torch.float32)
        logits[torch.arange(len(seqs)), torch.tensor(tokens)] = 1.0
        return ForwardOutput(logits=logits, new_kv=[None] * len(seqs))
