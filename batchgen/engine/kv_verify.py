"""The page-content oracle: a KV round trip gives back exactly the bytes it took, and a flush
writes exactly the pending K/V. It checks whichever KV path is authoritative, from outside it:

    when                        called from                what it does
    --------------------------  -------------------------  -----------------------------------------
    store (evict: GPU -> host)  the host pool's on_copy    digest the source GPU pages, per layer
    load  (migrate, retry)      the host pool's on_copy    note that the stored pages are landing
    after poll                  Worker.step                a load that landed (now RUNNING): digest
                                                           its GPU pages (cached pages it re-linked
                                                           included), == the stored digests
    flush                       Worker's flush (appends)   the pages appended into == the pages as
                                                           they were with the pending K/V in place

A difference is a divergence record of kind ``data`` (op ``poll`` for a round trip, ``flush`` for
an append), one per request and check, naming each page and layer that differ:
``requests[<uuid>].gpu_pages[<page id>].layers[<layer>]``. Records go to the compare log: the
compare run's own sink when compare mode is on (and its run summary carries the checks), else a
sink of its own on the same path (``BATCHGEN_WORKER_KV_COMPARE_LOG``). ``sample`` checks the
steps compare mode's sample picks (a round trip: when its store's step is picked). Copies between
the pools are counted by pattern (``copy_patterns``) on every step.
"""

from __future__ import annotations

import contextlib
import time
import uuid as uuid_lib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor

from batchgen.kv.backends import CopyOp
from batchgen.kv.copy_patterns import copy_patterns
from batchgen.kv.gate import KV_BINDING, KvGateConfig
from batchgen.kv.page_checks import PageMismatch, append_mismatches, expected_appends, mismatches
from batchgen.kv.page_digest import check_digestible, page_digests
from batchgen.kv.target import KvTarget
from batchgen.state import Phase
from compare import DataChecks, DivergenceRecord, JsonlSink, is_sampled_step


@dataclass(frozen=True, slots=True)
class _Stored:
    """A request's pages as a store took them: source GPU ids, host ids, digests ``[n, L]``."""

    step: int
    gpu_page_ids: tuple[int, ...]
    host_page_ids: tuple[int, ...]
    digests: Tensor


class KvVerifier:
    """The oracle over one worker's target. Mutates its own records and the log only."""

    def __init__(self, target: KvTarget, gate: KvGateConfig, sink: JsonlSink):
        """Watches ``target.host_kv``'s copies (sets its ``on_copy``); ValueError for pools whose
        pages cannot be digested."""
        check_digestible(target.gpu_kv.tensor)
        self.target, self.gate, self.sink = target, gate, sink
        self.run_id, self.workload, self.seed = f"verify-{uuid_lib.uuid4().hex[:8]}", "unnamed", 0
        # what minimize needs to rerun the workload: the compare run's, else the worker's paths
        # and configs (no workload: a run outside compare mode does not name it)
        self.replay = {
            "kv_path": gate.path,
            "shadow_path": gate.shadow_path,
            "vocab_size": target.model_config.vocab_size,
            "engine": target.engine_config.model_dump(mode="json"),
        }
        self._stored: dict[str, _Stored] = {}
        self._landing: dict[str, tuple[_Stored, tuple[int, ...]]] = {}  # uuid -> (stored, GPU ids)
        self.begin_run(self.run_id, workload=self.workload, seed=0, replay=self.replay)
        target.host_kv.on_copy = self.on_copy

    def begin_run(self, run_id: str, *, workload: str, seed: int, replay: dict) -> None:
        """Start counting a new run; its records carry these. Mutates self (pending round trips
        carry over: a worker's pages outlive a run)."""
        self.run_id, self.workload, self.seed, self.replay = run_id, workload, seed, replay
        self.checked: Counter[str] = Counter()
        self.divergences: Counter[str] = Counter()
        self.patterns: Counter[str] = Counter()
        self.seconds = 0.0

    def summary(self) -> DataChecks:
        return DataChecks(
            checked=dict(self.checked),
            divergences=dict(self.divergences),
            patterns=dict(self.patterns),
            seconds=self.seconds,
        )

    # ---- the hooks -------------------------------------------------------------------------
    def on_copy(self, op: CopyOp) -> None:
        """A copy between the pools, before it runs: count its patterns; a sampled store: digest
        its source GPU pages; a load: note where the stored pages land. Mutates self."""
        started = time.perf_counter()
        host, gpu = self.target.host_kv, self.target.gpu_kv
        self.patterns.update(
            copy_patterns(
                op.kind,
                op.src_page_ids,
                op.dst_page_ids,
                page_bytes=host.tensor[0].numel() * host.tensor.element_size(),
                host_to_host=not (host.tensor.is_cuda or gpu.tensor.is_cuda),
                split=host.copy_split,
            )
        )
        step = self.target.state.step
        if op.kind == "store":
            self._landing.pop(op.uuid, None)
            if self._sampled(step):
                digests = page_digests(gpu.tensor, op.src_page_ids)
                self._stored[op.uuid] = _Stored(step, op.src_page_ids, op.dst_page_ids, digests)
        elif op.uuid in self._stored:
            self._landing[op.uuid] = (self._stored[op.uuid], op.dst_page_ids)
        self.seconds += time.perf_counter() - started

    def check_loads(self) -> None:
        """After poll: each load that landed (its request RUNNING) against its store's digests;
        forget round trips whose request left the host tier otherwise. Mutates self, the log."""
        started = time.perf_counter()
        requests = self.target.state.requests
        for uuid in [u for u in self._stored if u not in requests]:
            del self._stored[uuid]
        for uuid, (stored, _) in list(self._landing.items()):
            req = requests.get(uuid)
            if req is not None and req.phase is Phase.LOADING:
                continue
            del self._landing[uuid]
            self._stored.pop(uuid, None)
            if req is not None and req.phase is Phase.RUNNING:
                # the whole table: cached pages a load re-linked (prefix caching), then the loaded
                page_ids = req.gpu_page_ids[: len(stored.gpu_page_ids)]
                found = page_digests(self.target.gpu_kv.tensor, page_ids)
                self.checked["load"] += len(page_ids)
                found_rows = mismatches(stored.digests, found)
                self._report("load", "poll", uuid, found_rows, list(page_ids), stored)
        self.seconds += time.perf_counter() - started

    @contextlib.contextmanager
    def appends(self) -> Iterator[None]:
        """Around the flush's write: on a sampled step, what each pending append's pages must hold
        after it, checked once it is done. Mutates self, the log."""
        target, step = self.target, self.target.state.step
        pending = target.pending_appends
        if not self._sampled(step) or not pending:
            yield
            return
        started = time.perf_counter()
        pool, requests = target.gpu_kv.tensor, target.state.requests
        appends = [
            (uuid, requests[uuid].gpu_page_ids, append.start_pos, append.kv)
            for uuid, append in pending.items()
            if append.kv is not None
        ]
        check = expected_appends(pool, appends) if appends else None
        self.seconds += time.perf_counter() - started
        yield
        if check is None:
            return
        started = time.perf_counter()
        self.checked["append"] += len(check.uuids)
        found, page_ids = append_mismatches(pool, check), check.page_ids.tolist()
        for uuid in dict.fromkeys(check.uuids):
            rows = [m for m in found if check.uuids[m.position] == uuid]
            self._report("append", "flush", uuid, rows, page_ids)
        self.seconds += time.perf_counter() - started

    # ---- records ---------------------------------------------------------------------------
    def _sampled(self, step: int) -> bool:
        return self.gate.verify == "all" or is_sampled_step(
            self.seed, step, self.gate.compare_sample
        )

    def _report(
        self,
        check: str,
        op: str,
        uuid: str,
        found: list[PageMismatch],
        page_ids: list[int],
        stored: _Stored | None = None,
    ) -> None:
        """Log one ``data`` divergence for ``uuid``'s mismatching page layers (none: nothing);
        ``page_ids``: the GPU page of each checked position. Mutates the log and the counts."""
        if not found:
            return
        rows = []
        for mismatch in found:
            row = {
                "gpu_page": page_ids[mismatch.position],
                "layer": mismatch.layer,
                "expected": f"{mismatch.expected & (2**64 - 1):016x}",
                "found": f"{mismatch.found & (2**64 - 1):016x}",
            }
            if stored is not None:  # where the round trip took the page from, and through
                row["stored_from_gpu_page"] = stored.gpu_page_ids[mismatch.position]
                row["host_page"] = stored.host_page_ids[mismatch.position]
                row["stored_at_step"] = stored.step
            rows.append(row)
        self.divergences[check] += 1
        self.sink.write(self._record(check, op, uuid, rows))

    def _record(self, check: str, op: str, uuid: str, rows: list[dict]) -> DivergenceRecord:
        paths = [f"requests[{uuid}].gpu_pages[{r['gpu_page']}].layers[{r['layer']}]" for r in rows]
        return DivergenceRecord(
            binding=KV_BINDING,
            run_id=self.run_id,
            workload=self.workload,
            seed=self.seed,
            step=self.target.state.step,
            op=op,
            authoritative=self.gate.path,
            shadow=self.replay.get("shadow_path", self.gate.shadow_path),
            kind="data",
            field_paths=paths,
            diff={"check": check, "request": uuid, "pages": rows},
            exception=None,
            replay={**self.replay, "op": op, "check": check},
            created_at=time.time(),
        )
