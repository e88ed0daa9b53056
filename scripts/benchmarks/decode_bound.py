"""A decode step against its bounds: on a GPU (``bench.py throughput``) the memory-bandwidth bound
of reading every weight and the KV once per step, at the copy bandwidth measured in the run; on
any device (``bench.py vllm``) the time of a decode step's matmuls alone, and of every matmul of a
whole run; on a CPU where a steady decode step's time goes (``step_breakdown``).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator

import torch

from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload
from batchgen.model.onednn_linear import OneDNNLinear
from batchgen.model.paged_attention import DecodeBatch
from batchgen.model.paged_decode import InPlaceDecodes

LINEARS = (torch.nn.Linear, OneDNNLinear)
DECODE_KINDS = (DecodeBatch, InPlaceDecodes)


def decode_steps(model, worker: Worker, job: Workload, device: str) -> dict:
    """Median decode-only step time of ``job`` on a fresh ``worker`` against the bound of reading
    every weight and the KV once per step at the measured device copy bandwidth."""
    for request in job.requests:
        worker.add_request(request.to_request())
    kv_bytes_per_token = model.config.num_layers * 2 * model.config.num_kv_heads
    kv_bytes_per_token *= model.config.head_dim * worker.gpu_kv.tensor.element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:  # a lookup reads a row per token, not the table
        embedding = model.model.embed_tokens.weight
        weight_bytes -= embedding.numel() * embedding.element_size()
    bandwidth = copy_bandwidth(device)
    step_s, bound_s = [], []
    while worker.has_unfinished():
        running = [r for r in worker.state.requests.values() if r.num_cached_tokens]
        before = worker.state.stats.tokens_generated
        torch.cuda.synchronize()
        started = time.perf_counter()
        worker.step()
        torch.cuda.synchronize()
        # decode-only steps: every request had its prompt cached and got one token
        if running and worker.state.stats.tokens_generated - before == len(running):
            step_s.append(time.perf_counter() - started)
            num_cached = sum(r.num_cached_tokens for r in running)
            bound_s.append((weight_bytes + num_cached * kv_bytes_per_token) / bandwidth)
    return {
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes": weight_bytes,
        "decode_step_ms": 1e3 * statistics.median(step_s),
        "bound_step_ms": 1e3 * statistics.median(bound_s),
        "bound_over_step": statistics.median(b / s for b, s in zip(bound_s, step_s)),
    }


def copy_bandwidth(device: str, num_bytes: int = 2**30) -> float:
    """Bytes/s moved (read + written) by the best of five device-to-device copies."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * num_bytes / best


def step_linears(model) -> list[torch.nn.Module]:
    """Every linear a forward runs, in order: each layer's projections and MLP, then
    ``lm_head``. Pure."""
    return [*(m for m in model.model.layers.modules() if isinstance(m, LINEARS)), model.lm_head]


def matmul_step_s(model, num_rows: int, repeats: int = 20) -> float:
    """Seconds of a decode step's matmuls alone for ``num_rows`` rows (every layer's projections
    and MLP, then ``lm_head``) on the model's own weights: the best of ``repeats``."""
    weight = model.model.embed_tokens.weight
    linears = step_linears(model)
    inputs = {  # one [rows, in_features] input per width, as the step's matmuls read
        m.in_features: torch.randn(
            num_rows, m.in_features, dtype=weight.dtype, device=weight.device
        )
        for m in linears
    }
    best = math.inf
    with torch.inference_mode():
        for _ in range(repeats):
            started = time.perf_counter()
            for linear in linears:
                linear(inputs[linear.in_features])
            best = min(best, time.perf_counter() - started)
    return best


@contextlib.contextmanager
def timed_linears(model) -> Iterator[list[float]]:
    """Inside the block, the wall seconds of every call of every linear of ``model`` (its layers'
    and ``lm_head``) add up in the one-element list yielded. Mutates the linears' hooks while
    inside (two ``perf_counter`` calls a matmul); synchronous devices only (the CPU)."""
    with timed_modules(step_linears(model)) as seconds:
        yield seconds


@contextlib.contextmanager
def timed_modules(modules: list[torch.nn.Module]) -> Iterator[list[float]]:
    """Inside the block, the wall seconds of every call of ``modules`` add up in the one-element
    list yielded. Mutates their hooks while inside; synchronous devices only (the CPU)."""
    seconds, started = [0.0], {}

    def start(module, inputs) -> None:
        started[module] = time.perf_counter()

    def stop(module, inputs, output) -> None:
        seconds[0] += time.perf_counter() - started.pop(module)

    handles = []
    for module in modules:
        handles += [module.register_forward_pre_hook(start), module.register_forward_hook(stop)]
    try:
        yield seconds
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def timed_decode_attention() -> Iterator[list[float]]:
    """Inside the block, the wall seconds of every decode attention call (either kind of
    ``AttentionPlan.decodes``) add up in the one-element list yielded. Mutates both classes'
    ``attend`` while inside."""
    seconds, originals = [0.0], {cls: cls.attend for cls in DECODE_KINDS}
    depth = [0]  # a call inside a timed call (the in-place kind's float32 pass) is not counted

    def timed(original):
        def attend(self, *args) -> None:
            depth[0] += 1
            started = time.perf_counter()
            try:
                original(self, *args)
            finally:
                depth[0] -= 1
            if not depth[0]:
                seconds[0] += time.perf_counter() - started

        return attend

    for cls, original in originals.items():
        cls.attend = timed(original)
    try:
        yield seconds
    finally:
        for cls, original in originals.items():
            cls.attend = original


def step_breakdown(model, worker: Worker, job: Workload) -> dict:
    """Where a steady decode step of ``job`` goes on a fresh ``worker`` (CPU): the median over its
    steps that decode ``max_num_seqs`` rows and nothing else of the step's wall ms and of its
    parts' shares: the layers' matmuls, ``lm_head``, decode attention, and the rest (norms, RoPE,
    SiLU, the sampler, the K/V write, the worker); beside it the matmuls alone at those rows
    (``matmul_step_s``)."""
    for request in job.requests:
        worker.add_request(request.to_request())
    layers = step_linears(model)[:-1]
    parts: dict[str, list[float]] = {"layer_matmuls": [], "lm_head": [], "decode_attention": []}
    step_s = []
    with (
        timed_modules(layers) as layer_s,
        timed_modules([model.lm_head]) as head_s,
        timed_decode_attention() as attention_s,
    ):
        while worker.has_unfinished():
            running = [r for r in worker.state.requests.values() if r.num_cached_tokens]
            before = worker.state.stats.tokens_generated
            layer_s[0] = head_s[0] = attention_s[0] = 0.0
            started = time.perf_counter()
            worker.step()
            elapsed = time.perf_counter() - started
            decoded = worker.state.stats.tokens_generated - before
            if len(running) == job.engine.max_num_seqs == decoded:
                step_s.append(elapsed)
                for name, seconds in zip(parts, (layer_s, head_s, attention_s)):
                    parts[name].append(seconds[0])
    row = {"rows": job.engine.max_num_seqs, "num_steps": len(step_s)}
    row["step_ms"] = 1e3 * statistics.median(step_s)
    for name, seconds in parts.items():
        row[f"{name}_share"] = statistics.median(s / t for s, t in zip(seconds, step_s))
    row["rest_share"] = 1 - sum(row[f"{name}_share"] for name in parts)
    row["matmul_only_ms"] = 1e3 * matmul_step_s(model, job.engine.max_num_seqs)
    return row
