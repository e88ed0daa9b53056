"""Time to first token in ``bench.py vllm --model real --cells ttft``: from a process's start to its
first token, for one chat line of ``max_tokens`` 1, greedy, in float32, each engine a fresh
process on one CPU with one thread and its default pools:

    batchgen       ``batchgen generate --threads 1`` on the HF directory
    batchgen GGUF  the same on the GGUF file (its weights dequantized at load)
    vLLM           ``vllm_runner.py --first-token``: ``LLM(the HF directory)`` and one ``chat``,
                   its KV cache 4 GiB as batchgen's (``vllm_ttft_env``)

Each is timed from outside, from just before its process starts to the line it writes once its
token is out (batchgen's ``--json`` summary, vLLM's token). After one run of each (so numba's
compiled kernels and vLLM's compiled graph are in their caches: the figures are warm), the three
alternate for ``--pairs`` rounds; the ratio is batchgen's time over vLLM's, median over rounds with
its spread (goal: at most 0.2x). The cold figure, once: numba's and vLLM's caches in empty
directories (``NUMBA_CACHE_DIR``, ``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``). The GGUF
file's dequantization alone is timed in this process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table

from batchgen.model import loader
from batchgen.model.gguf_checkpoint import gguf_weights, read_gguf_config
from batchgen.model.real_model import fetch_real_model
from batchgen.validation.hf_reference import reference_directory

from .ab_timer import interleaved, median_ratio
from .vllm_job import RUNNER, vllm_env

PROMPT = "Write one sentence about the sea."
SERVED_NAME = "m"
CPUS = [0]  # one CPU, one thread: the first this process may use
ENGINES = ("batchgen", "batchgen GGUF", "vLLM")


def chat_line(prompt: str = PROMPT) -> str:
    """The batch input line: one chat message, one new token, greedy. Pure."""
    body = dict(model=SERVED_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=1)
    body["temperature"] = 0
    return json.dumps(dict(custom_id="ttft", method="POST", url="/v1/chat/completions", body=body))


def batchgen_command(model: str, workdir: Path) -> list[str]:
    """``batchgen generate`` of the one line in ``workdir`` on ``model``, one thread. Pure."""
    inputs, outputs = workdir / "ttft.jsonl", workdir / "ttft-out.jsonl"
    return [sys.executable, "-m", "batchgen", "generate", "-i", str(inputs), "-o", str(outputs)] + [
        "--model", model, "--served-model-name", SERVED_NAME, "--threads", "1", "--json"
    ]  # fmt: skip


def vllm_command(python: Path, model: str) -> list[str]:
    """vLLM's first token of ``PROMPT`` on ``model`` in float32 on ``CPUS``. Pure."""
    cpus = ",".join(map(str, CPUS))
    return [str(python), str(RUNNER), "--first-token", model, "float32", cpus, PROMPT]


def vllm_ttft_env() -> dict:
    """vLLM's environment on ``CPUS`` with a KV cache of 4 GiB, as batchgen's default pools
    (``--kv-cache-gib``): left unset, vLLM asks for 92% of the machine's memory and refuses to
    start where other processes hold more than 8% of it. Pure read."""
    return dict(vllm_env(",".join(map(str, CPUS))), VLLM_CPU_KVCACHE_SPACE="4")


def first_line_s(command: list[str], env: dict, log: Path) -> float:
    """Seconds from just before ``command`` starts (on ``CPUS``) to its first line of standard
    output that is a JSON object; waits for it to exit. RuntimeError naming ``log`` where none
    comes, or where it reports other than one token (batchgen's summary ``tokens_generated``,
    vLLM's ``token_ids``)."""
    with log.open("a") as stderr:
        started = time.perf_counter()
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=dict(env, PYTHONUNBUFFERED="1"),
            preexec_fn=lambda: os.sched_setaffinity(0, CPUS),
        )
        seconds, reported = None, {}
        for line in process.stdout:
            if line.startswith("{"):
                seconds, reported = time.perf_counter() - started, json.loads(line)
                break
        process.stdout.read()
        if process.wait() or seconds is None:
            raise RuntimeError(f"{command[:4]} exited ({process.returncode}); see {log}")
    if reported.get("tokens_generated", len(reported.get("token_ids", ()))) != 1:
        raise RuntimeError(f"{command[:4]} gave no token: {reported}; see {log}")
    return seconds


def dequantization_s(path: Path) -> float:
    """Seconds to read and dequantize every tensor of the GGUF file at ``path`` (its pages
    already in the page cache from a run before)."""
    config = read_gguf_config(path)
    shapes = loader._expected_shapes(loader._meta_model(config))
    started = time.perf_counter()
    for _ in gguf_weights(path, shapes, config):
        pass
    return time.perf_counter() - started


def measure_ttft(python: Path, pairs: int, log: Path) -> dict:
    """The cold figure of each engine once, then warm: one run each, ``pairs`` alternating
    rounds; medians, the ratios and the GGUF file's dequantization."""
    directory, gguf = str(reference_directory()), str(fetch_real_model())
    with tempfile.TemporaryDirectory() as workdir:
        (Path(workdir) / "ttft.jsonl").write_text(chat_line() + "\n")
        commands = {
            "batchgen": (batchgen_command(directory, Path(workdir)), dict(os.environ)),
            "batchgen GGUF": (batchgen_command(gguf, Path(workdir)), dict(os.environ)),
            "vLLM": (vllm_command(python, directory), vllm_ttft_env()),
        }
        cold = {}
        for engine, (command, env) in commands.items():
            caches = Path(workdir) / f"cold-{engine.replace(' ', '-')}"
            env = dict(env, NUMBA_CACHE_DIR=str(caches / "numba"))
            env.update(VLLM_CACHE_ROOT=str(caches / "vllm"))
            env["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
            cold[engine] = first_line_s(command, env, log)
        for command, env in commands.values():  # the caches as a later run finds them
            first_line_s(command, env, log)
        warm = interleaved(
            ENGINES, pairs, lambda engine: first_line_s(*commands[engine], log), rotate=False
        )
    record = {"cold_s": cold, "warm_s": warm, "dequantization_s": dequantization_s(Path(gguf))}
    for engine in ("batchgen", "batchgen GGUF"):
        median, ratios = median_ratio(warm[engine], warm["vLLM"])
        record[f"ratio {engine}"] = dict(median=median, min=min(ratios), max=max(ratios))
    return record


def render_ttft(record: dict) -> Table:
    """Each engine's time to first token, warm (median, range) and cold, and batchgen's ratios to
    vLLM's. Pure."""
    table = Table(title="Time to first token: process start to the first token, one CPU")
    for column in ("engine", "warm s", "range", "cold s", "over vLLM's (warm)", "goal"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    for engine in ENGINES:
        warm = record["warm_s"][engine]
        ratio = record.get(f"ratio {engine}")
        table.add_row(
            engine,
            f"{statistics.median(warm):.2f}",
            f"{min(warm):.2f}-{max(warm):.2f}",
            f"{record['cold_s'][engine]:.2f}",
            f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "",
            "<= 0.20x" if ratio else "",
        )
    table.caption = f"the GGUF file's dequantization alone: {record['dequantization_s']:.2f} s"
    return table
