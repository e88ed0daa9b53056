"""One run as the metrics see it: the worker's counters after each step, its requests' times, and
the gauges a scrape reads.

The runner hands ``LiveRun.chain`` its step and release callbacks (``batchgen.engine.runner``);
a driver of its own (``batchgen.text.generation.TextEngine``) calls ``submitted``, ``release`` and
``end_step`` itself. After each step the run adds the increase of the worker's counters (and
compare mode's) to the counters and the step's seconds to the step histogram: a few integers per
step, nothing per request. Request times count in steps' wall times: a request arrives at the
start of its arrival step, its first token comes at the end of the step that sampled it, it is
done at the end of the step that sampled its last token (the next step releases it)::

    started_at[k]   when the run's step k started (k relative to the run's first step)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from batchgen.state import Phase, RequestOutput, WorkerStats

# counter (without _total) -> the WorkerStats counter whose increase it counts, what it counts
WORKER_COUNTERS = {
    "num_preemptions": ("recompute_preemptions", "requests preempted for recompute"),
    "evictions": ("evictions", "requests whose KV went from GPU to host"),
    "loads": ("loads", "host to GPU loads started (retries included)"),
    "load_failures": ("load_failures", "host to GPU loads that failed"),
    "generation_tokens": ("tokens_generated", "tokens generated"),
    "prefix_cache_queries": (
        "prefix_cache_queries",
        "tokens of the requests admitted with prefix caching on, looked up in the cache",
    ),
    "prefix_cache_hits": ("prefix_cache_hits", "of those, tokens taken from cached pages"),
}
PHASE_GAUGES = {  # gauge -> the phase it counts requests in
    "num_requests_running": Phase.RUNNING,
    "num_requests_waiting": Phase.WAITING,
    "num_requests_swapped": Phase.SWAPPED,
    "num_requests_loading": Phase.LOADING,
}


class LiveRun:
    """A run the metrics watch. Mutates the metrics' counters and itself."""

    def __init__(self, metrics, worker, workload: str, requests=()) -> None:
        """``requests``: the run's workload requests (arrival steps relative to the run's first
        step, prompts), read once; requests submitted later are ``submitted`` one by one."""
        self.metrics, self.worker, self.workload = metrics, worker, workload
        self._start_step = worker.state.step
        self._arrivals = {r.uuid: (r.arrival_step, len(r.prompt_ids)) for r in requests}
        self._stats: WorkerStats = worker.state.stats.copy()
        host = worker.host_kv
        self._page_bytes = host.page_bytes
        self._copied = (dict(host.pages_copied), dict(host.copy_seconds))
        self._compare = _CompareTotals()
        self.started_at = [time.perf_counter()]

    def chain(self, on_step: Callable | None, on_release: Callable | None) -> tuple:
        """The runner's ``on_step`` and ``on_release``, each also counting for the metrics. Pure."""

        def stepped(num_released: int, num_requests: int) -> None:
            self.end_step()
            if on_step is not None:
                on_step(num_released, num_requests)

        def released(output: RequestOutput) -> None:
            self.release(output)
            if on_release is not None:
                on_release(output)

        return stepped, released

    def submitted(self, request) -> None:
        """``request`` (an engine ``Request``) arrives now, at the worker's next step. Mutates
        self."""
        step = self.worker.state.step - self._start_step
        self._arrivals[request.uuid] = (step, len(request.prompt_ids))

    def end_step(self) -> None:
        """A step ended: its seconds, the increase of the worker's counters and of compare mode's.
        Mutates the counters and self."""
        now = time.perf_counter()
        metrics, workload = self.metrics, self.workload
        metrics.step_seconds.labels(workload).observe(now - self.started_at[-1])
        self.started_at.append(now)
        self._add_worker_counters()
        compare = self.worker.kv_compare
        if compare is not None:
            self._compare.add(metrics, workload, compare.executor.stats())

    def _add_worker_counters(self) -> None:
        """Add the increase of the worker's counters and of its copies between the tiers since the
        last step. Mutates the counters and self."""
        metrics, workload, stats = self.metrics, self.workload, self.worker.state.stats
        for name, counter in metrics.worker_counters.items():
            field = WORKER_COUNTERS[name][0]
            increase = getattr(stats, field) - getattr(self._stats, field)
            if increase:
                counter.labels(workload).inc(increase)
        self._stats = stats.copy()
        host, (pages_before, seconds_before) = self.worker.host_kv, self._copied
        for direction, pages in host.pages_copied.items():
            if pages != pages_before[direction]:
                num_bytes = (pages - pages_before[direction]) * self._page_bytes
                metrics.offload_bytes.labels(workload, direction).inc(num_bytes)
                seconds = host.copy_seconds[direction] - seconds_before[direction]
                metrics.offload_seconds.labels(workload, direction).inc(seconds)
        self._copied = (dict(host.pages_copied), dict(host.copy_seconds))

    def release(self, output: RequestOutput) -> None:
        """A request of the run was released: its latency, its first token's, its prompt tokens.
        Mutates the metrics."""
        arrival = self._arrivals.get(output.uuid)
        if arrival is None:
            return
        arrival_step, num_prompt_tokens = arrival
        metrics, arrived = self.metrics, self.started_at[arrival_step]
        metrics.latency.labels(self.workload).observe(self.started_at[-1] - arrived)
        metrics.prompt_tokens.labels(self.workload).inc(num_prompt_tokens)
        first = output.first_token_step
        if first is not None and first - self._start_step + 1 < len(self.started_at):
            first_token_at = self.started_at[first - self._start_step + 1]
            metrics.ttft.labels(self.workload).observe(first_token_at - arrived)

    def gauges(self) -> dict[str, float]:
        """The gauges' values now, read from the worker (one pass over its live requests). Pure:
        a scrape may call it from another thread while the worker steps."""
        worker = self.worker
        phases = Counter(req.phase for req in list(worker.state.requests.values()))
        values = {name: float(phases[phase]) for name, phase in PHASE_GAUGES.items()}
        values["gpu_kv_usage_perc"] = _usage(worker.gpu_kv)
        values["host_kv_usage_perc"] = _usage(worker.host_kv)
        compare = worker.kv_compare
        if compare is not None:
            values["kv_compare_sample_rate"] = compare.executor.sample_rate
            governor = compare.governor
            values["kv_compare_breaker_open"] = float(
                governor is not None and governor.breaker_step is not None
            )
        return values


class _CompareTotals:
    """Compare mode's counters as last added, so each step adds only their increase."""

    def __init__(self) -> None:
        self.ops: dict[str, int] = {}
        self.outcomes: dict[str, int] = {}
        self.harness_errors, self.seconds = 0, 0.0

    def add(self, metrics, workload: str, stats) -> None:
        """Add the increase from the last ``stats`` to these. Mutates the metrics and self."""
        for op, count in stats.num_compared.items():
            if count != self.ops.get(op, 0):
                metrics.compare_ops.labels(workload, op).inc(count - self.ops.get(op, 0))
                self.ops[op] = count
        for outcome, tally in stats.coverage.items():
            if tally.count != self.outcomes.get(outcome, 0):
                increase = tally.count - self.outcomes.get(outcome, 0)
                metrics.outcomes.labels(workload, outcome).inc(increase)
                self.outcomes[outcome] = tally.count
        if stats.num_harness_errors != self.harness_errors:
            metrics.harness_errors.labels(workload).inc(
                stats.num_harness_errors - self.harness_errors
            )
            self.harness_errors = stats.num_harness_errors
        if stats.compare_seconds > self.seconds:
            metrics.compare_seconds.labels(workload).inc(stats.compare_seconds - self.seconds)
            self.seconds = stats.compare_seconds


def _usage(pool) -> float:
    return (pool.num_pages - pool.free_pages()) / pool.num_pages if pool.num_pages else 0.0
