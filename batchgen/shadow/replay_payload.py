"""What a KV divergence record carries in its ``replay`` field, for ``batchgen replay`` and
``minimize`` (``batchgen.triage.rebuild`` reads it back): the op's request and pre-state, both
pools' events as each side logged them, and what minimize needs of the run to rerun its
workload."""

from __future__ import annotations

from batchgen.kv.plans import to_jsonable
from batchgen.kv.target import KvTarget
from batchgen.shadow.fork import pre_state
from compare import Comparison


def run_payload(
    target: KvTarget,
    *,
    paths: tuple[str, str],
    workload_source: str,
    scale: float,
    faults: str | None,
    demo_bug: str | None,
) -> dict:
    """What minimize needs of a run to rerun its workload (every record of it carries this):
    the (authoritative, shadow) ``paths``, the workload's source and scale, the fault SPEC and the
    demo bug planted in the shadow path (replay plants it again). Pure."""
    return {
        "kv_path": paths[0],
        "shadow_path": paths[1],
        "workload_source": workload_source,
        "scale": scale,
        # built-in traces draw their token ids, and so their lengths, from it
        "vocab_size": target.model_config.vocab_size,
        "engine": target.engine_config.model_dump(mode="json"),  # --kv-load-* included
        "faults": faults,
        **({"demo_bug": demo_bug} if demo_bug else {}),
    }


def op_payload(op: str, request, target: KvTarget, comparison: Comparison, run: dict) -> dict:
    """A divergence record's ``replay``: ``op``'s ``request`` (None: no side planned it) and its
    pre-state on ``target`` (the worker's, recorded), both sides' pool events, and ``run``'s
    payload. Pure."""
    pre = None if request is None else pre_state(op, request, target)
    return {
        "op": op,
        "request_type": type(request).__name__,
        "request": to_jsonable(request),
        "pre_state": None if pre is None else to_jsonable(pre),
        "pools": {
            "authoritative": (comparison.authoritative.value or {}).get("pools"),
            "shadow": (comparison.shadow.value or {}).get("pools"),
        },
        **run,
    }
