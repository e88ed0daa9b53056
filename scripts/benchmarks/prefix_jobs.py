"""The jobs of ``bench.py prefix`` and batchgen's side of a run.

    shared   N chat lines: the model's chat template (``apply_chat_template``) applied to one
             system prompt and a short user question of its own per line, token ids from the
             tokenizer; the system prompt is cut so that the tokens every line shares (the
             template's head, the system prompt, the head of the user turn) are exactly
             ``shared_tokens``
    unique   the same lengths, each line drawn at random from the tokenizer's ordinary ids (those
             after its added tokens), seeded: no page is shared

batchgen runs a job on a fresh worker whose GPU pool holds the ``max_num_seqs`` longest lines at
once (as vLLM's KV cache), prefix caching on or off (``CacheConfig.enable_prefix_caching``), EOS
ignored. Its prefill tokens computed are measured at the model: the tokens every forward of the
run was given, less the decode tokens (every output token but each line's last is forwarded once).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

from batchgen.config import pages_needed
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker

from .ab_timer import timed_run
from .throughput import Mix, workload
from .vllm_measure import ignoring_eos

# the system prompt: these words cycled, each clause numbered, until the shared tokens are reached
SYSTEM_WORDS = (
    "Answer in plain words, keep each reply short, name the step you took first, say what you"
    " did not check, prefer numbers to adjectives, and ask when the question is unclear"
).split()
TOPICS = ("caching", "batching", "paging", "sampling", "scheduling", "memory", "tokens", "threads")


def chat_ids(tokenizer, system: str, question: str) -> list[int]:
    """The token ids of one chat line: ``system`` and ``question`` through the tokenizer's chat
    template, ending with the assistant's turn. Pure."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def common_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares. Pure."""
    length = min(map(len, prompts))
    for other in prompts[1:]:
        length = next((i for i in range(length) if other[i] != prompts[0][i]), length)
    return length


def question(line: int) -> str:
    """Line ``line``'s user question: short, its own. Pure."""
    return f"{line}. Which rule above matters most for {TOPICS[line % len(TOPICS)]}, and why?"


def system_prompt(tokenizer, shared_tokens: int) -> str:
    """The system prompt (``SYSTEM_WORDS`` cycled) after which chat lines share exactly
    ``shared_tokens`` tokens; ValueError when no cut of the words gives that many. Pure."""
    words: list[str] = []
    while True:
        clause = len(words) // len(SYSTEM_WORDS) + 1
        word = SYSTEM_WORDS[len(words) % len(SYSTEM_WORDS)]
        words.append(f"{clause}. {word}" if len(words) % len(SYSTEM_WORDS) == 0 else word)
        text = " ".join(words)
        shared = common_prefix([chat_ids(tokenizer, text, question(i)) for i in (0, 1)])
        if shared == shared_tokens:
            return text
        if shared > shared_tokens:
            raise ValueError(
                f"--shared-tokens {shared_tokens}: no system prompt gives exactly that many shared"
                f" tokens with this tokenizer (the next has {shared}); try {shared}"
            )


def shared_job(tokenizer, lines: int, shared_tokens: int, new_tokens: int, at_once: int) -> Mix:
    """``lines`` chat lines sharing ``shared_tokens`` tokens, ``new_tokens`` each, ``at_once`` at a
    time. Pure."""
    system = system_prompt(tokenizer, shared_tokens)
    prompts = [chat_ids(tokenizer, system, question(i)) for i in range(lines)]
    return Mix("shared", prompts, [new_tokens] * lines, at_once, ("fcfs",))


def unique_job(shared: Mix, tokenizer, vocab_size: int, seed: int) -> Mix:
    """``shared``'s lengths and new tokens, each prompt seeded ordinary ids (after the tokenizer's
    added tokens, below ``vocab_size``): nothing shared. Pure."""
    rng = random.Random(seed)
    first = max(tokenizer.added_tokens_decoder, default=-1) + 1
    prompts = [[rng.randrange(first, vocab_size) for _ in prompt] for prompt in shared.prompts]
    return Mix("unique", prompts, shared.new_tokens, shared.max_num_seqs, ("fcfs",))


def at_once_tokens(mix: Mix) -> int:
    """A step's token budget (both engines') that admits the ``max_num_seqs`` longest prompts at
    once. Pure."""
    longest = sorted(map(len, mix.prompts))[-mix.max_num_seqs :]
    return sum(longest) + len(longest)


def at_once_mix(mix: Mix) -> Mix:
    """The ``max_num_seqs`` longest requests of ``mix``: what the KV cache holds at once. Pure."""
    order = sorted(range(len(mix.prompts)), key=lambda i: len(mix.prompts[i]) + mix.new_tokens[i])
    keep = order[-mix.max_num_seqs :]
    prompts, new = [mix.prompts[i] for i in keep], [mix.new_tokens[i] for i in keep]
    return Mix(mix.name, prompts, new, mix.max_num_seqs, mix.schedule_policies)


def new_worker(model, mix: Mix, page_size: int, caching: bool):
    """A worker for ``mix`` (pools holding its ``max_num_seqs`` longest requests at once, the
    budget of ``at_once_tokens``, prefix caching per ``caching``, EOS ignored) and its workload."""
    dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    job = workload(mix, dtype, "fcfs", page_size)
    held = at_once_mix(mix)
    pages = sum(pages_needed(len(p) + n, page_size) for p, n in zip(held.prompts, held.new_tokens))
    cache = job.cache.model_copy(
        update=dict(num_gpu_pages=pages + 1, enable_prefix_caching=caching)
    )
    engine = job.engine.model_copy(update=dict(max_num_batched_tokens=at_once_tokens(mix)))
    job = job.model_copy(update=dict(cache=cache, engine=engine))
    worker = Worker(model, cache_config=cache, engine_config=engine, device="cpu")
    return ignoring_eos(worker), job


@contextlib.contextmanager
def forwarded_tokens(model) -> Iterator[list[int]]:
    """Inside the block, the tokens every ``model.forward`` call is given add up in the
    one-element list yielded. Mutates ``model.forward`` (an instance attribute) while inside."""
    count, forward = [0], model.forward

    def counting(seqs, kv_pages):
        count[0] += sum(len(seq.token_ids) for seq in seqs)
        return forward(seqs, kv_pages)

    model.forward = counting
    try:
        yield count
    finally:
        del model.forward


def run_batchgen(model, mix: Mix, page_size: int, caching: bool) -> dict:
    """One batchgen run of ``mix`` on a fresh worker (``new_worker``; its construction untimed):
    wall and CPU seconds, outputs and tokens per request, prefill tokens computed, and the prefix
    cache's query and hit tokens."""
    worker, job = new_worker(model, mix, page_size, caching)
    with forwarded_tokens(model) as forwarded:
        timed = timed_run(lambda: run_workload(worker, job))
    results = [timed.result.outputs[f"r{i}"] for i in range(len(mix.prompts))]
    outputs = [list(result.output_ids) for result in results]
    stats = worker.state.stats
    run = dict(wall_s=timed.wall_s, cpu_s=timed.cpu_s, results=results, outputs=outputs)
    run["prefill_tokens"] = forwarded[0] - sum(len(output) - 1 for output in outputs)
    run.update(hit_tokens=stats.prefix_cache_hits, query_tokens=stats.prefix_cache_queries)
    return run
