"""A checked body's prompts as token ids, and the seed a line without one takes."""

from __future__ import annotations

import hashlib

from batchgen.openai.request_body import BodyError, ChatBody, CompletionBody
from batchgen.text.tokenizer import TextTokenizer

SEED_BITS = 63


def line_seed(job_seed: int, custom_id: str) -> int:
    """The seed of a line that names none: a hash of the job's ``--seed`` and the line's
    custom_id, so a rerun draws the same. Pure."""
    digest = hashlib.blake2b(f"{job_seed}:{custom_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


def prompt_ids(body: CompletionBody | ChatBody, tokenizer: TextTokenizer) -> list[tuple[int, ...]]:
    """The prompts of ``body`` as token ids: the chat template's rendering of the messages; a
    completion prompt as a string, a token list, or a list of either (one prompt each). BodyError
    (400) for an empty prompt, a token id outside the vocabulary, or a template that refuses."""
    if isinstance(body, ChatBody):
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            return [tuple(tokenizer.encode_chat(messages))]
        except ValueError as error:
            raise BodyError(400, f"messages: {error}", "messages") from None
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise BodyError(400, "prompt: an empty list; give a string or token ids", "prompt")
    prompts = [tuple(tokenizer.encode(p)) if isinstance(p, str) else tuple(p) for p in prompt]
    vocab = tokenizer.vocab_size
    for ids in prompts:
        if not ids:
            raise BodyError(400, "prompt: empty; a prompt needs at least one token", "prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BodyError(400, f"prompt: token ids {bad[:5]} outside [0, {vocab})", "prompt")
    return prompts
