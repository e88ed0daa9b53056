"""The edge's one way from a parsed KV gate to a worker's KV side (``batchgen.kv.ops``).

    kv_ops_for(gate)          target -> the path the gate names, or compare mode (this package),
                              and the page-content oracle when ``verify`` is on
    gated_options(gate, ...)  a Worker's options with that KV side, its engine config
                              carrying the gate's load failure policy and its cache config
                              the gate's prefix caching
    gated_worker(model, ...)  a Worker built with them
    KvDirection               which path serves and which is shadowed (``DIRECTIONS``: the
                              three a validation runs)

The CLI, ``batchgen.LLM``, validation, sweeps and triage build their workers here; the worker
itself reads no environment and imports none of this.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.faults import FaultInjector
from batchgen.engine.kv_verify import KvVerifier
from batchgen.engine.worker import Worker
from batchgen.finish.shadow import FinishGateConfig, finish_ops_for
from batchgen.kv.gate import KvGateConfig, build_kv_path
from batchgen.kv.ops import KvFactory, KvSetup
from batchgen.kv.target import KvTarget
from batchgen.shadow.kv_compare import KvCompare
from compare import JsonlSink


@dataclass(frozen=True, slots=True)
class KvDirection:
    """One compare-mode configuration: the path that serves and the path shadowed on forks."""

    authoritative: str
    shadow: str

    @property
    def role(self) -> str:
        return f"{self.authoritative}/{self.shadow}"

    @property
    def is_noise_check(self) -> bool:
        """A/A: the shadow is the authoritative path itself, so a divergence is harness noise."""
        return self.authoritative == self.shadow


DIRECTIONS = (
    KvDirection("legacy", "plan"),
    KvDirection("plan", "legacy"),
    KvDirection("plan", "plan"),
)


def kv_ops_for(
    gate: KvGateConfig, *, shadow_path: str | None = None, faults: str | None = None
) -> KvFactory:
    """What a worker's KV side is under ``gate``: its path, or compare mode (``shadow_path``
    overrides the compared path: the authoritative one itself is the A/A noise check; ``faults``:
    the fault SPEC the worker runs under, recorded with each divergence); and the page-content
    oracle when ``gate.verify`` is on and pages hold bytes, its records in compare mode's log.
    Pure."""

    def build(target: KvTarget) -> KvSetup:
        compare = None
        if gate.compare != "off":
            compare = KvCompare(target, gate, shadow_path=shadow_path, faults=faults)
        ops = compare if compare is not None else build_kv_path(gate.path, target)
        if gate.verify == "off" or target.gpu_kv.tensor is None:
            return KvSetup(ops, gate, compare)
        sink = compare.sink if compare is not None else JsonlSink(gate.compare_log)
        verifier = KvVerifier(target, gate, sink)
        if compare is not None:
            compare.verifier = verifier
        return KvSetup(ops, gate, compare, verifier)

    return build


def gated_options(
    kv_gate: KvGateConfig,
    *,
    shadow_path: str | None = None,
    finish_gate: FinishGateConfig | None = None,
    **worker_options,
) -> dict:
    """``worker_options`` (``Worker``'s) with the KV side ``kv_gate`` sets (``kv_ops_for``, the
    fault SPEC of ``faults`` recorded), the gate's load failure policy over ``engine_config`` and
    its prefix caching over ``cache_config``, and the finish step ``finish_gate`` sets (None: its
    defaults; ``shadow_path`` is both slices' shadowed path: both name theirs plan and legacy).
    Pure."""
    faults: FaultInjector | None = worker_options.get("faults")
    spec = faults.spec.to_spec() if faults is not None else None
    return {
        **worker_options,
        "cache_config": kv_gate.cache_config(worker_options["cache_config"]),
        "engine_config": kv_gate.engine_config(worker_options.get("engine_config")),
        "kv_ops": kv_ops_for(kv_gate, shadow_path=shadow_path, faults=spec),
        "finish_ops": finish_ops_for(finish_gate or FinishGateConfig(), shadow_path=shadow_path),
    }


def gated_worker(model, *, kv_gate: KvGateConfig, shadow_path: str | None = None, **options):
    """A worker whose KV side ``kv_gate`` sets, and its finish step ``finish_gate`` in ``options``
    (``gated_options``)."""
    return Worker(model, **gated_options(kv_gate, shadow_path=shadow_path, **options))
