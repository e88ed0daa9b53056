"""The workers a validation runs on: compare-mode workers (a direction's gates, logging to the
session's log, validation's copy split; the finish step shadowed in the same direction, raising at
its first divergence) and plain ones (plan path, compare mode off)."""

from __future__ import annotations

from pathlib import Path

import torch

from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.faults import FaultInjector
from batchgen.engine.worker import Worker
from batchgen.finish.gate import FinishGateConfig
from batchgen.kv.copy_runs import CopySplit
from batchgen.kv.gate import KvGateConfig
from batchgen.shadow.wiring import KvDirection, gated_worker

# Validation's pools are a few hundred KiB, far below the 4 MiB from which production splits a
# batch: its compare workers split a store or load from 64 KiB (8 of the tiny model's 8 KiB pages)
# on two threads, whatever torch's thread count, so both the split and the unsplit copy run.
VALIDATION_COPY_SPLIT = CopySplit(min_bytes=64 * 2**10, num_threads=2)


def compare_gate(direction: KvDirection, log: Path, *, fail_fast: bool) -> KvGateConfig:
    """A compare run's gates: its direction, logging every divergence to ``log`` (``fail_fast``:
    raising at the first, after logging it). Pure."""
    mode = "raise" if fail_fast else "log"
    return KvGateConfig(
        path=direction.authoritative, compare=mode, compare_log=str(log), verify="all"
    )


def compare_worker(
    model,
    device: str | torch.device,
    direction: KvDirection,
    gate: KvGateConfig,
    cache: CacheConfig,
    engine: EngineConfig,
    faults: FaultInjector | None = None,
) -> Worker:
    """A worker serving ``direction``'s authoritative path and shadowing it under ``gate``, its
    host pool copying with ``VALIDATION_COPY_SPLIT``; its finish step too, in raise mode, logging
    through the KV side's sink (one writer per log)."""
    finish = FinishGateConfig(
        path=direction.authoritative, compare="raise", compare_log=gate.compare_log
    )
    worker = gated_worker(
        model,
        cache_config=cache,
        engine_config=engine,
        kv_gate=gate,
        finish_gate=finish,
        shadow_path=direction.shadow,
        faults=faults,
        device=device,
    )
    worker.host_kv.copy_split = VALIDATION_COPY_SPLIT
    worker.finish_compare.sink = worker.kv_compare.sink
    return worker


def plain_worker(
    model, device: str | torch.device, cache: CacheConfig, engine: EngineConfig
) -> Worker:
    """A worker on the default (plan) path with compare mode off, whatever the environment
    says."""
    return Worker(model, cache_config=cache, engine_config=engine, device=device)
