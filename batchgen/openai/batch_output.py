"""Result lines in the OpenAI batch output shape::

    {"id": "batch_req_<hex>", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "req_<hex>",
                  "body": {"id": "cmpl-<hex>", "object": "text_completion", "created": 1700000000,
                           "model": "m", "choices": [{"index": 0, "text": "...",
                           "finish_reason": "length", "logprobs": null}],
                           "usage": {"prompt_tokens": 5, "completion_tokens": 16,
                                     "total_tokens": 21,
                                     "prompt_tokens_details": {"cached_tokens": 0}}}},
     "error": null}

``usage`` counts each prompt once, however many samples (``n``) it has; ``cached_tokens``: of
``prompt_tokens``, those taken from the prefix cache (each prompt's first sample's; 0 with caching
off: OpenAI always writes it).

A chat line's body is a ``chat.completion`` whose choices hold ``message`` ({"role": "assistant",
"content": ...}). A line refused for its request gets ``response`` with ``status_code`` 400 or 404
and ``body.error`` {message, type, param, code}; a line with no request to read (not JSON, no
custom_id) gets ``response`` null and ``error`` {code, message, line}. Ids are hashes of the
custom_id, so a rerun writes the same ids; ``created`` is the time the line finished.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

from batchgen.openai.request_body import CHAT
from batchgen.state import TokenLogprobs
from batchgen.text.generation import PromptResult

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "internal_error"}


def _hex_id(kind: str, custom_id: str | None, number: int) -> str:
    key = f"{kind}:{custom_id if custom_id is not None else f'line {number}'}"
    return hashlib.blake2b(key.encode(), digest_size=12).hexdigest()


def _envelope(custom_id: str | None, number: int, response: dict | None, error: dict | None):
    return {
        "id": f"batch_req_{_hex_id('batch', custom_id, number)}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def success_line(
    custom_id: str,
    url: str,
    model: str,
    results: Sequence[PromptResult],
    token_text: Callable[[int], str],
) -> dict:
    """The result line of a line whose prompts all completed (``results``, in prompt order; its
    choices numbered prompt by prompt, sample by sample). ``token_text`` names a token in
    log-probabilities. Pure but for the clock."""
    chat = url == CHAT
    choices = []
    for result in results:
        for completion in result.completions:
            choice = {"index": len(choices)}
            if chat:
                choice["message"] = {"role": "assistant", "content": completion.text}
            else:
                choice["text"] = completion.text
            choice["finish_reason"] = completion.finish_reason
            lps = completion.logprobs
            shape = _chat_logprobs if chat else _completion_logprobs
            choice["logprobs"] = (
                None if lps is None else shape(completion.token_ids, lps, token_text)
            )
            choices.append(choice)
    num_prompt = sum(len(r.prompt_ids) for r in results)
    num_completion = sum(len(c.token_ids) for r in results for c in r.completions)
    num_cached = sum(r.num_cached_tokens for r in results)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{_hex_id('body', custom_id, 0)}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": num_cached},
        },
    }
    response = {
        "status_code": 200,
        "request_id": f"req_{_hex_id('req', custom_id, 0)}",
        "body": body,
    }
    return _envelope(custom_id, 0, response, None)


def request_error_line(custom_id: str, status: int, message: str, param: str | None) -> dict:
    """The result line of a request refused with ``status`` (400, 404; 500: the engine failed
    it). Pure."""
    error = {"message": message, "type": ERROR_TYPES[status], "param": param, "code": None}
    response = {
        "status_code": status,
        "request_id": f"req_{_hex_id('req', custom_id, 0)}",
        "body": {"error": error},
    }
    return _envelope(custom_id, 0, response, None)


def line_error_line(number: int, custom_id: str | None, message: str) -> dict:
    """The result line of input line ``number`` that holds no request to read. Pure."""
    error = {"code": "invalid_request_line", "message": message, "line": number}
    return _envelope(custom_id, number, None, error)


def _completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], token_text: Callable[[int], str]
) -> dict:
    """The completions endpoint's shape: parallel lists of tokens, their log-probabilities, the top
    ones as {token: logprob}, and each token's offset in the text. Pure."""
    tokens = [token_text(t) for t in token_ids]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.token_logprob for lp in logprobs],
        "top_logprobs": [{token_text(i): v for i, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def _chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], token_text: Callable[[int], str]
) -> dict:
    """The chat endpoint's shape: per token its text, log-probability, UTF-8 bytes and top
    alternatives. Pure."""

    def entry(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t, lp.token_logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
            for t, lp in zip(token_ids, logprobs)
        ]
    }
