"""A replicated job's Prometheus metrics, kept by the driver: each replica's worker counters (the
increase each block brings back) and the divergences its compare records log, under the
``workload`` and ``replica`` labels (the replica's slot, 0 to N-1; a replica started again in a
slot keeps its number). The counters count the work that came back: a replica that ended takes
the increase of its last block with it, and that block runs again.

::

    batchgen:num_preemptions_total, evictions_total, loads_total, load_failures_total,
    batchgen:generation_tokens_total                          {workload, replica}
    batchgen:kv_compare_divergences_total                     {workload, replica, op, kind}
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter

from batchgen.metrics.live import WORKER_COUNTERS
from batchgen.metrics.worker_metrics import P
from compare import DivergenceRecord


class ReplicaMetrics:
    """The driver's metrics (served by ``batchgen.metrics.exporter.exporting``). Mutates only its
    own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.port: int | None = None  # where /metrics is served, once it is
        labels = ("workload", "replica")
        self.worker_counters = {
            field: Counter(P + name, doc, labels, registry=self.registry)
            for name, (field, doc) in WORKER_COUNTERS.items()
        }
        self.divergences = Counter(
            P + "kv_compare_divergences",
            "divergences logged",
            (*labels, "op", "kind"),
            registry=self.registry,
        )

    def add(self, workload: str, replica: int, counters: Mapping[str, int], records=()) -> None:
        """Add a block's counter increases (WorkerStats field -> increase) and count the
        divergences among its compare ``records`` (parsed). Mutates the counters."""
        for field, increase in counters.items():
            counter = self.worker_counters.get(field)
            if counter is not None:
                counter.labels(workload, str(replica)).inc(increase)
        for record in records:
            if isinstance(record, DivergenceRecord):
                self.divergences.labels(workload, str(replica), record.op, record.kind).inc()
