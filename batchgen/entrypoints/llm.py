"""``batchgen.LLM``: the engine embedded in a program (an RL rollout loop, a notebook).

::

    from batchgen import LLM, Sampling

    llm = LLM("tiny-ckpt")                      # an HF checkpoint directory, or a GGUF file
    outs = llm.generate(["Once upon a time"], Sampling(max_tokens=8, temperature=0.0))
    outs[0].completions[0].text                 # the text, its token ids, finish_reason, logprobs

The same ``Worker`` as ``batchgen run`` and ``generate`` runs underneath, with the same KV gate
(``kv_gate``, else the ``BATCHGEN_WORKER_KV_*`` environment). Prefix caching is on, as in vLLM's
``LLM``: ``enable_prefix_caching`` given beats the gate's ``prefix_cache``, as a CLI option beats
the environment; each result's ``num_cached_tokens`` says how many prompt tokens came from it. A
prompt's samples draw from (seed, the prompt's index in the call, sample index, position): a call
repeated gives the same tokens, on any batch composition unless a float near-tie flips.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from batchgen.config import EngineConfig
from batchgen.engine.host_malloc import keep_freed_memory
from batchgen.entrypoints.pool_sizes import DEFAULT_CPU_KV_GIB, cache_config
from batchgen.finish.gate import FINISH_GATES, FinishGateConfig
from batchgen.kv.gate import KvGateConfig, gate_config
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker
from batchgen.text.generation import PromptResult, TextEngine, TextPrompt
from batchgen.text.generation_defaults import read_generation_defaults
from batchgen.text.sampling import Sampling
from batchgen.text.tokenizer import TextTokenizer

Prompt = str | Sequence[int]


class LLM:
    """A checkpoint's model and tokenizer on one worker. Not thread-safe: one ``generate`` at a
    time."""

    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        page_size: int = 16,
        gpu_pages: int | None = None,
        host_pages: int | None = None,
        kv_cache_gib: float = DEFAULT_CPU_KV_GIB,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        generation_config: str = "auto",
        kv_gate: KvGateConfig | None = None,
        enable_prefix_caching: bool | None = None,
        finish_gate: FinishGateConfig | None = None,
    ):
        """Load the model and tokenizer of ``model`` (an HF directory or a GGUF file); pools sized
        as ``pool_sizes`` says; sampling defaults from ``generation_config`` (as ``generate
        --generation-config``); prefix caching on unless ``enable_prefix_caching`` (else the KV
        gate) turns it off; the finish step as ``finish_gate`` (else the environment) says.
        ModelLoadError / TokenizerError / GenerationConfigError naming what is wrong, ValueError
        for an ``enable_prefix_caching`` not a bool or None. Sets the process's malloc to keep
        freed memory (``host_malloc``), as the command line does."""
        gate = _gate(kv_gate, enable_prefix_caching)
        finish = finish_gate if finish_gate is not None else FINISH_GATES.parse(os.environ)
        keep_freed_memory()
        self.defaults = read_generation_defaults(model, generation_config)
        self.tokenizer = TextTokenizer(model)
        loaded = load_model(str(model), device=device, dtype=dtype, max_model_len=max_model_len)
        sizes = dict(gpu_pages=gpu_pages, host_pages=host_pages, kv_cache_gib=kv_cache_gib)
        cache = cache_config(
            loaded.config, device=device, dtype=dtype, page_size=page_size,
            max_num_seqs=max_num_seqs, **sizes,
        )  # fmt: skip
        engine = EngineConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        )
        self.worker = gated_worker(
            loaded, cache_config=cache, engine_config=engine, kv_gate=gate, finish_gate=finish,
            device=device,
        )  # fmt: skip
        self._engine = TextEngine(self.worker, self.tokenizer)

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling: Sampling | None = None
    ) -> list[PromptResult]:
        """Complete each prompt (text, or token ids) with ``sampling`` (default: OpenAI's
        completion defaults under the checkpoint's generation config); results in prompt order.
        RequestError naming the prompt the engine refuses, before any runs. Mutates the
        worker."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        ids = [self._prompt_ids(p) for p in prompts]
        return self._run(ids, sampling or self.default_sampling(max_tokens=16))

    def chat(
        self, conversations: Sequence[list[dict]], sampling: Sampling | None = None
    ) -> list[PromptResult]:
        """Reply to each conversation (a list of ``{"role", "content"}`` messages) through the
        checkpoint's chat template; ``sampling`` defaults to the rest of the context, as OpenAI's
        chat endpoint does, under the checkpoint's generation config. Mutates the worker."""
        ids = [tuple(self.tokenizer.encode_chat(list(c))) for c in conversations]
        return self._run(ids, sampling or self.default_sampling(max_tokens=None))

    def default_sampling(self, max_tokens: int | None) -> Sampling:
        """OpenAI's defaults with ``max_tokens``, under the generation config's defaults and its
        ``max_new_tokens`` cap (vLLM's ``get_default_sampling_params``). Pure."""
        return Sampling(max_tokens=self.defaults.capped(max_tokens), **self.defaults.sampling)

    def _prompt_ids(self, prompt: Prompt) -> tuple[int, ...]:
        if isinstance(prompt, str):
            return tuple(self.tokenizer.encode(prompt))
        return tuple(prompt)

    def _run(self, prompt_ids: list[tuple[int, ...]], sampling: Sampling) -> list[PromptResult]:
        """Run the prompts to the end; results in prompt order. Mutates the worker."""
        text_prompts = [TextPrompt(str(i), ids, sampling) for i, ids in enumerate(prompt_ids)]
        for prompt in text_prompts:  # refuse a bad prompt before any is queued
            self._engine.check(prompt)
        for prompt in text_prompts:
            self._engine.add(prompt)
        results: dict[str, PromptResult] = {}
        while self._engine.has_unfinished():
            results.update((r.key, r) for r in self._engine.step())
        return [results[p.key] for p in text_prompts]


def _gate(kv_gate: KvGateConfig | None, enable_prefix_caching: bool | None) -> KvGateConfig:
    """``kv_gate`` (None: the environment's, parsed here, once) with ``enable_prefix_caching``
    over its ``prefix_cache`` when given, as an option over the environment. ValueError for a
    value that is not a bool or None. Reads the environment."""
    if enable_prefix_caching is not None and not isinstance(enable_prefix_caching, bool):
        raise ValueError(
            f"enable_prefix_caching={enable_prefix_caching!r}; allowed: True, False, or None"
            " (the gate's, else on)"
        )
    caching = None if enable_prefix_caching is None else "on" if enable_prefix_caching else "off"
    if kv_gate is None:
        return gate_config(os.environ, {"prefix_cache": caching})
    return kv_gate if caching is None else kv_gate.model_copy(update={"prefix_cache": caching})


def _is_token_ids(prompt) -> bool:
    return isinstance(prompt, Sequence) and bool(prompt) and isinstance(prompt[0], int)
