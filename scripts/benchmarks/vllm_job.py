"""What both engines of ``bench.py vllm`` share: the checkpoint (weights, config, a tokenizer), the
mixes, and the handle on a vLLM runner process (``vllm_runner.py`` in vLLM's venv).
"""

from __future__ import annotations

import contextlib
import ctypes.util
import json
import os
import random
import signal
import subprocess
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models

from .hf_checkpoint import save_checkpoint
from .throughput import Mix

RUNNER = Path(__file__).with_name("vllm_runner.py")
MAX_MODEL_LEN = 512  # the longest request: 128 prompt + 256 new tokens
MAX_NUM_BATCHED_TOKENS = 4096  # vLLM's chunked-prefill budget per step


def geometry(name: str, vocab_size: int) -> dict:
    """HF LlamaConfig keys of ``HxL``: heads H/32 (head_dim 32), KV heads H/64, intermediate
    8H/3 rounded down to a multiple of 8; ValueError naming what is wrong. Pure."""
    hidden, _, layers = name.partition("x")
    if not (hidden.isdigit() and layers.isdigit() and int(hidden) % 64 == 0 and int(layers)):
        raise ValueError(f"geometry {name!r}: expected HxL with H a multiple of 64 and L >= 1")
    hidden_size = int(hidden)
    return dict(
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3 // 8 * 8,
        num_hidden_layers=int(layers),
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=hidden_size // 64,
        head_dim=32,
        vocab_size=vocab_size,
    )


def save_checkpoint_with_tokenizer(path: str, geometry_keys: dict, seed: int) -> None:
    """A seeded float32 HF Llama in ``path`` and a word-level tokenizer of its vocabulary beside it
    (vLLM loads one even for token-id prompts). Writes into ``path``."""
    save_checkpoint(path, geometry_keys, seed, torch.float32)
    vocab = {f"t{i}": i for i in range(geometry_keys["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)


def build_mixes(names: list[str], vocab_size: int, seed: int) -> list[Mix]:
    """The seeded requests of each mix named: ``static`` (32 requests, prompts 16-128, 64 new,
    32 at a time) and ``mixed`` (64 requests, prompts 16-128, 16-256 new, 16 at a time). Pure."""
    rng = random.Random(seed)

    def prompts(count: int) -> list[list[int]]:
        lengths = [rng.randint(16, 128) for _ in range(count)]
        return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]

    mixes = {
        "static": Mix("static", prompts(32), [64] * 32, 32, ("fcfs",)),
        "mixed": Mix(
            "mixed", prompts(64), [rng.randint(16, 256) for _ in range(64)], 16, ("fcfs",)
        ),
    }
    return [mixes[name] for name in names]


def vllm_preload() -> str:
    """``LD_PRELOAD`` for vLLM's process: tcmalloc where the system has it (Debian's
    ``libtcmalloc-minimal4``), as vLLM's CPU install guide asks and as its engine warns without
    it, added to this process's own; batchgen's side keeps freed memory its own way
    (``host_malloc``). Pure read."""
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    inherited = os.environ.get("LD_PRELOAD", "")
    return ":".join(filter(None, (tcmalloc, inherited)))


def vllm_env(cpus: str) -> dict:
    """The environment of a vLLM process on ``cpus`` (``bind_cpus``): its compute threads bound
    to them, tcmalloc preloaded (``vllm_preload``), offline. Pure read."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpus, LD_PRELOAD=vllm_preload())
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def bind_cpus(threads: int) -> str:
    """The CPU ids both engines run on with ``threads`` threads: the first ones this process may
    use (``VLLM_CPU_OMP_THREADS_BIND`` syntax). Pure read."""
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0))[:threads])


class VllmRunner:
    """One ``vllm_runner.py`` process holding one ``vllm.LLM``; ``run`` sends it a mix."""

    def __init__(
        self,
        python: Path,
        checkpoint: str,
        mix: Mix,
        threads: int,
        page_size: int,
        log: Path,
        *,
        workdir: str | None = None,
        dtype: str = "float32",
        batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
        kv_cache_gib: int = 1,
        max_model_len: int = MAX_MODEL_LEN,
        prefix_caching: bool = False,
    ):
        """Starts the process (all of vLLM on the first ``threads`` CPUs, its compute threads
        bound to them, ``dtype`` weights, KV blocks of ``page_size`` tokens in a cache of
        ``kv_cache_gib`` GiB, at most ``batched_tokens`` tokens a step and ``max_model_len`` a
        request, its prefix cache on with ``prefix_caching``) and waits until its model is loaded;
        writes the job file into ``workdir`` (default ``checkpoint``) and vLLM's logs to
        ``log``."""
        job = Path(workdir or checkpoint) / f"vllm-job-{mix.name}.json"
        cpus = bind_cpus(threads)
        settings = dict(checkpoint=checkpoint, max_num_seqs=mix.max_num_seqs, dtype=dtype)
        # every process of vLLM runs on these CPUs (vllm_runner), not only its compute threads
        settings["cpus"] = [int(cpu) for cpu in cpus.split(",")]
        settings.update(max_model_len=max_model_len, max_num_batched_tokens=batched_tokens)
        # each run sends the same prompts: a prefix cache would skip their prefill after the first
        # (with ``prefix_caching`` the runner empties it before each run)
        settings.update(
            engine_args=dict(enable_prefix_caching=prefix_caching, block_size=page_size)
        )
        job.write_text(json.dumps(settings))
        env = vllm_env(cpus)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        self.log = log
        with log.open("a") as stderr:
            self.process = subprocess.Popen(
                [str(python), str(RUNNER), str(job)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
                start_new_session=True,  # a process group of its own, for ``paused``
            )
        self._read()  # {"ready": true}

    def run(self, mix: Mix) -> dict:
        """vLLM's ``wall_s`` and ``outputs`` (tokens per request, request order) for ``mix``."""
        self.process.stdin.write(json.dumps(dict(prompts=mix.prompts, new_tokens=mix.new_tokens)))
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        return self._read()

    @contextlib.contextmanager
    def paused(self):
        """Every process of vLLM stopped (SIGSTOP to the runner's process group) for the block,
        continued after it. Idle, vLLM's front end and engine core still wake a few hundred times a
        second on the CPUs batchgen runs on: on one core that cost a 256x4 static batchgen run
        4-13% (0.55 s alone, 0.57-0.63 s beside them), each wake-up evicting its caches."""
        os.killpg(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.process.pid, signal.SIGCONT)

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM runner exited ({self.process.wait()}); see {self.log}")
        return json.loads(line)

    def close(self) -> None:
        """Ends the runner process and waits for it."""
        self.process.stdin.close()
        self.process.wait(timeout=120)
