"""A run's KV timeline: pages held and KV events, one value per step, for the HTML report.

The runner records every step it runs; compare mode puts the arrays in the run's summary
(``RunSummary.timeline``), ``batchgen run --timeline FILE`` writes them as JSON. Counters, one
value per step, taken after the step::

    gpu_pages       GPU pages held (fault reservations included)
    host_pages      host pages held
    evictions       RUNNING -> SWAPPED this step
    loads           host -> GPU loads started this step (retries included)
    load_failures   loads that failed this step
    recomputes      requests preempted for recompute this step

Levels, constant over the run: ``gpu_capacity`` and ``host_capacity`` (pages in each pool) and
``gpu_watermark`` (GPU pages that can be held before eviction starts: the capacity less the
pages the watermark keeps free).
"""

from __future__ import annotations

from batchgen.state import WorkerStats
from compare import Timeline

# counter -> the lifetime WorkerStats counter whose per-step increase it records
EVENT_COUNTERS = {
    "evictions": "evictions",
    "loads": "loads",
    "load_failures": "load_failures",
    "recomputes": "recompute_preemptions",
}
COUNTERS = ("gpu_pages", "host_pages", *EVENT_COUNTERS)


class TimelineRecorder:
    """Appends the worker's counters after each step of one run. Mutates only itself."""

    def __init__(self, worker) -> None:
        """Start at the worker's next step (``worker.state.step``). Pure on the worker."""
        self.first_step = worker.state.step
        self.levels = {
            "gpu_capacity": worker.gpu_kv.num_pages,
            "gpu_watermark": worker.gpu_kv.num_pages - worker.cache_config.watermark_pages,
            "host_capacity": worker.host_kv.num_pages,
        }
        self.counters: dict[str, list[int]] = {name: [] for name in COUNTERS}
        self._totals = _event_totals(worker.state.stats)

    def record(self, worker) -> None:
        """Append the values of the step the worker just ran. Mutates self."""
        counters = self.counters
        counters["gpu_pages"].append(worker.gpu_kv.num_pages - worker.gpu_kv.free_pages())
        counters["host_pages"].append(worker.host_kv.num_pages - worker.host_kv.free_pages())
        totals = _event_totals(worker.state.stats)
        for name, total, last in zip(EVENT_COUNTERS, totals, self._totals):
            counters[name].append(total - last)
        self._totals = totals

    def timeline(self) -> Timeline:
        """What was recorded so far, as the log's record. Pure."""
        counters = {name: list(values) for name, values in self.counters.items()}
        return Timeline(first_step=self.first_step, counters=counters, levels=dict(self.levels))


def _event_totals(stats: WorkerStats) -> tuple[int, ...]:
    return tuple(getattr(stats, field) for field in EVENT_COUNTERS.values())
