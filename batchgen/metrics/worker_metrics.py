"""A command's Prometheus metrics: vLLM's names with a ``batchgen:`` prefix, in a registry of its
own (no process-wide default registry), labelled by workload and nothing per request.

::

    gauges, read from the live run when scraped (nothing per step)
      batchgen:num_requests_running, _waiting, _swapped, _loading      requests by phase
      batchgen:gpu_kv_usage_perc, batchgen:host_kv_usage_perc          pages held / pages, 0 to 1
      batchgen:kv_compare_sample_rate, batchgen:kv_compare_breaker_open
    counters, from the worker's counters after each step (their increase)
      batchgen:num_preemptions_total, evictions_total, loads_total, load_failures_total
      batchgen:prompt_tokens_total, generation_tokens_total
      batchgen:prefix_cache_queries_total, prefix_cache_hits_total    in tokens, as vLLM's
      batchgen:kv_offload_bytes_total{direction}, kv_offload_seconds_total{direction}
      batchgen:kv_compare_ops_total{op}, kv_compare_harness_errors_total,
      batchgen:kv_compare_seconds_total, kv_decision_outcomes_total{outcome}
    counters, as compare mode writes its records
      batchgen:kv_compare_divergences_total{op,kind}
    histograms
      batchgen:step_duration_seconds, time_to_first_token_seconds, e2e_request_latency_seconds

Every series also has the ``workload`` label. A command with several runs (validate) counts over
all of them; ``add_run`` adds a run that ran elsewhere (a sweep's, explore's) by its log lines
(the counters its timeline holds: the prefix cache's are not among them).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from batchgen.engine.timeline import EVENT_COUNTERS
from batchgen.metrics.live import PHASE_GAUGES, WORKER_COUNTERS, LiveRun
from compare import DivergenceRecord, RunSummary, parse_record

P = "batchgen:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# the kinds batchgen's compare mode names (batchgen.shadow.forms, and the page-content oracle's)
DIVERGENCE_KINDS = ("state", "copies", "exception", "invalid_plan", "data")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# attribute -> (name without the prefix and _total, help, labels beside workload)
COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "prompt tokens of the requests released", ()),
    "offload_bytes": ("kv_offload_bytes", "KV bytes copied between the tiers", ("direction",)),
    "offload_seconds": (
        "kv_offload_seconds",
        "seconds of the calls issuing KV copies between the tiers",
        ("direction",),
    ),
    "compare_ops": ("kv_compare_ops", "KV ops compared", ("op",)),
    "divergences": ("kv_compare_divergences", "divergences logged", ("op", "kind")),
    "harness_errors": ("kv_compare_harness_errors", "failures inside the compare harness", ()),
    "compare_seconds": ("kv_compare_seconds", "seconds compare mode added to the KV ops", ()),
    "outcomes": (
        "kv_decision_outcomes",
        "KV policy decision outcomes reached by compared ops",
        ("outcome",),
    ),
}
# attribute -> (name, help, buckets)
HISTOGRAMS = {
    "step_seconds": ("step_duration_seconds", "seconds of one worker step", STEP_BUCKETS),
    "ttft": (
        "time_to_first_token_seconds",
        "from the start of a request's arrival step to the end of its first token's",
        LATENCY_BUCKETS,
    ),
    "latency": (
        "e2e_request_latency_seconds",
        "from the start of a request's arrival step to the end of its last token's",
        LATENCY_BUCKETS,
    ),
}


class WorkerMetrics:
    """The metrics of one command. Mutates only its own registry and the live run it watches."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.live: LiveRun | None = None  # the run going on now (the gauges read it)
        self.port: int | None = None  # where /metrics is served, once it is
        self.worker_counters = {
            name: Counter(P + name, doc, ("workload",), registry=self.registry)
            for name, (_, doc) in WORKER_COUNTERS.items()
        }
        for attribute, (name, doc, labels) in COUNTERS.items():
            counter = Counter(P + name, doc, ("workload", *labels), registry=self.registry)
            setattr(self, attribute, counter)
        for attribute, (name, doc, buckets) in HISTOGRAMS.items():
            histogram = Histogram(
                P + name, doc, ("workload",), buckets=buckets, registry=self.registry
            )
            setattr(self, attribute, histogram)
        self.registry.register(_LiveGauges(self))

    def begin_run(self, worker, workload: str, requests=()) -> LiveRun:
        """Watch the run named ``workload`` on ``worker`` from now on (the gauges read it), its
        ``requests`` those of its workload (``LiveRun``); its compare records are counted as they
        are written. Mutates self and the worker's compare binding."""
        self.live = LiveRun(self, worker, workload, requests)
        self._start_at_zero(worker, workload)
        if worker.kv_compare is not None:
            worker.kv_compare.on_record = self.count_record
        return self.live

    def _start_at_zero(self, worker, workload: str) -> None:
        """Create the run's series at 0, so that an alert's ``increase()`` sees the first event.
        Mutates the registry."""
        for counter in (*self.worker_counters.values(), self.prompt_tokens):
            counter.labels(workload)
        for direction in worker.host_kv.pages_copied:
            self.offload_bytes.labels(workload, direction)
            self.offload_seconds.labels(workload, direction)
        compare = worker.kv_compare
        if compare is None:
            return
        self.harness_errors.labels(workload)
        self.compare_seconds.labels(workload)
        for op in compare.gate.compare_ops:
            self.compare_ops.labels(workload, op)
            for kind in DIVERGENCE_KINDS:
                self.divergences.labels(workload, op, kind)

    def count_record(self, record) -> None:
        """Count a compare record as it is written (a divergence, by op and kind). Mutates the
        counters."""
        if isinstance(record, DivergenceRecord):
            self.divergences.labels(record.workload, record.op, record.kind).inc()

    def add_run(self, lines: Sequence[str], workload: str | None = None) -> None:
        """Add a run that ran elsewhere (a sweep's, explore's), by its log lines: its divergences,
        and the counters its summary holds, labelled ``workload`` (None: the run's own). Mutates
        the counters."""
        for line in lines:
            record = parse_record(line)
            if workload is not None:
                record = record.model_copy(update={"workload": workload})
            if isinstance(record, RunSummary):
                self.add_summary(record)
            else:
                self.count_record(record)

    def add_summary(self, summary: RunSummary) -> None:
        """Add the counters of a run's summary: compare mode's, and the KV events of its timeline.
        Mutates the counters."""
        workload = summary.workload
        self.harness_errors.labels(workload)  # at 0, as a watched run's
        for op, count in summary.steps_compared.items():
            self.compare_ops.labels(workload, op).inc(count)
        self.harness_errors.labels(workload).inc(summary.harness_errors)
        self.compare_seconds.labels(workload).inc(summary.compare_seconds)
        for outcome, tally in summary.coverage.items():
            self.outcomes.labels(workload, outcome).inc(tally.count)
        counters = summary.timeline.counters if summary.timeline is not None else {}
        in_timeline = {field: name for name, field in EVENT_COUNTERS.items()}
        for name, (field, _) in WORKER_COUNTERS.items():
            if in_timeline.get(field) in counters:
                values = counters[in_timeline[field]]
                self.worker_counters[name].labels(workload).inc(sum(values))


class _LiveGauges:
    """The gauges of the live run, computed when the registry is collected (a scrape, the final
    file): one pass over the live requests per scrape, none per step."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics

    def collect(self):
        live = self._metrics.live
        families = {
            name: GaugeMetricFamily(P + name, doc, labels=["workload"])
            for name, doc in (
                *((name, f"requests {phase.value}") for name, phase in PHASE_GAUGES.items()),
                ("gpu_kv_usage_perc", "GPU KV pages held, a fraction of the pool"),
                ("host_kv_usage_perc", "host KV pages held, a fraction of the pool"),
                ("kv_compare_sample_rate", "fraction of steps compare mode compares now"),
                ("kv_compare_breaker_open", "1 when the breaker turned compare mode off"),
            )
        }
        if live is not None:
            for name, value in live.gauges().items():
                families[name].add_metric([live.workload], value)
        yield from families.values()
