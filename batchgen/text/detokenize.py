"""Incremental detokenization for stop strings: a sample's text grows one token at a time (the
``tokenizers`` library's ``DecodeStream``), and each new piece is searched for the stop strings.

A stop string may straddle tokens, so each search starts ``len(longest stop) - 1`` characters
before the new piece. The text is cut where the first stop string starts: as OpenAI does, the
output excludes it (the token ids keep the tokens that spelled it).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class StopStringWatch:
    """One sample's decoded text, watched for ``stops``. Mutates itself only."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stops = stops
        self._overlap = max(len(stop) for stop in stops) - 1
        self.text = ""
        self.num_tokens = 0  # tokens fed so far
        self.stopped = False

    def feed(self, token_ids: list[int]) -> bool:
        """Add ``token_ids`` (the sample's next tokens) until a stop string completes; returns
        whether one has (``text`` then ends just before it). Mutates ``text``, ``num_tokens``,
        ``stopped``."""
        for token in token_ids:
            if self.stopped:
                return True
            self.num_tokens += 1
            piece = self._stream.step(self._tokenizer, token)
            if piece:
                start = max(0, len(self.text) - self._overlap)
                self.text += piece
                self._cut_at_stop(start)
        return self.stopped

    def _cut_at_stop(self, start: int) -> None:
        """Cut ``text`` at the earliest stop string found from ``start`` on. Mutates ``text``,
        ``stopped``."""
        found = [i for i in (self.text.find(stop, start) for stop in self._stops) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True
