"""What a validation run must show: each check is a pure function returning its failure lines
(none when the run passed it), each line naming the run and what failed."""

from __future__ import annotations

from batchgen.config import pages_needed, watermark_pages
from batchgen.engine.runner import RunResult
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload
from batchgen.shadow.wiring import KvDirection
from batchgen.validation.output_check import compare_exact, compare_outputs
from compare import DivergenceRecord, Report, RunSummary

# Counters that must match between a shared and the fresh L2-4096 run (peaks are lifetime maxima,
# so not these).
SAME_RUN_COUNTERS = (
    "steps", "evictions", "loads", "load_failures", "recompute_preemptions", "tokens_generated",
)  # fmt: skip
_MAX_NAMED_PATHS = 3  # field paths a divergence failure line names


def divergence_failures(
    label: str, direction: KvDirection, summary: RunSummary, first: DivergenceRecord | None
) -> list[str]:
    """A line for a compare run's harness errors, and one for its divergences naming the
    ``first``. Pure."""
    failures = []
    if summary.harness_errors:
        failures.append(
            f"{label}: {_plural(summary.harness_errors, 'compare harness error')} "
            "(the comparison itself failed; see the warnings)"
        )
    num_divergences = sum(summary.divergences.values())
    if num_divergences:
        by_op = ", ".join(f"{op}: {n}" for op, n in sorted(summary.divergences.items()) if n)
        noise = (
            " (A/A noise check: both sides run the same path)" if direction.is_noise_check else ""
        )
        failures.append(
            f"{label}: {_plural(num_divergences, 'divergence')} of the {direction.shadow} shadow"
            f" from the authoritative {direction.authoritative} path{noise} ({by_op}); first:"
            f" {_describe(first)}"
        )
    return failures


def data_failures(label: str, summary: RunSummary, first: DivergenceRecord | None) -> list[str]:
    """A line for a compare run's data divergences (page bytes its oracle found changed), naming
    the ``first``. Pure."""
    num_data = sum(summary.data.divergences.values()) if summary.data is not None else 0
    if not num_data:
        return []
    checks = ", ".join(f"{check}: {n}" for check, n in sorted(summary.data.divergences.items()))
    return [
        f"{label}: {_plural(num_data, 'data divergence')} (page bytes that did not survive a"
        f" copy or write; {checks}); first: {_describe(first)}"
    ]


def copy_pattern_failures(compare: Report, required: tuple[str, ...]) -> list[str]:
    """A line naming each copy pattern of ``required`` (``kv.copy_patterns``) no run issued.
    Pure."""
    issued = dict(compare.data_patterns)
    missed = [pattern for pattern in required if not issued.get(pattern)]
    if not missed:
        return []
    return [f"copy patterns: never issued: {', '.join(missed)}"]


def leftover_failures(label: str, worker: Worker, result: RunResult) -> list[str]:
    """A line for each thing a run left behind: pages held, loads in flight, live requests, an
    inconsistent pool. Pure."""
    leftovers = {
        "GPU pages held": result.leaked_gpu_pages,
        "host pages held": result.leaked_host_pages,
        "loads in flight": result.loads_in_flight,
        "live requests": result.live_requests,
    }
    failures = [
        f"{label}: {count} {what} after the run (expected 0)"
        for what, count in leftovers.items()
        if count
    ]
    try:
        worker.check_integrity()
    except AssertionError as error:
        failures.append(f"{label}: integrity check failed after the run: {first_line(error)}")
    return failures


def eviction_failures(label: str, result: RunResult) -> list[str]:
    """A line when a run never evicted to host: it did not exercise the host tier. Pure."""
    if result.stats.evictions:
        return []
    return [
        f"{label}: never evicted to host (recompute preemptions:"
        f" {result.stats.recompute_preemptions}), so the run did not exercise the host"
        " tier; use a larger --scale"
    ]


def pressure_failures(reference: RunResult) -> list[str]:
    """A line when a reference run, meant to see no KV pressure, saw some. Pure."""
    stats = reference.stats
    if not (stats.evictions or stats.loads or stats.recompute_preemptions):
        return []
    return [
        f"{reference.workload} reference: its pool was meant to avoid all KV pressure but"
        f" it saw {stats.evictions} evictions, {stats.loads} loads,"
        f" {stats.recompute_preemptions} recomputes"
    ]


def reference_failures(
    reference: RunResult, shared: RunResult, label: str, tolerance: float
) -> list[str]:
    """A shared run's tokens vs the no-eviction reference, near-ties allowed. Pure."""
    return [
        f"{label} vs reference: {problem}"
        for problem in compare_outputs(reference.outputs, shared.outputs, tolerance=tolerance)
    ]


def fresh_failures(fresh: RunResult, shared: RunResult, label: str) -> list[str]:
    """A shared worker's run of the last workload must be the fresh worker's: tokens, steps and
    counters. Pure."""
    label = f"{label} vs fresh"
    failures = [f"{label}: {problem}" for problem in compare_exact(fresh.outputs, shared.outputs)]
    fresh_counters, shared_counters = _run_counters(fresh), _run_counters(shared)
    return failures + [
        f"{label}: {name} {shared_counters[name]} on the shared worker, {value} on a fresh one"
        for name, value in fresh_counters.items()
        if shared_counters[name] != value
    ]


def coverage_failures(compare: Report) -> list[str]:
    """A failure line for the required outcomes no run reached, one for the required
    interactions, and one for outcomes or interactions reached that the catalog says no run can
    reach. Pure."""
    failures = []
    kinds = {row.outcome: row.kind for row in compare.coverage}
    for kind, label in (("outcome", "decision"), ("interaction", "interaction")):
        missed = [outcome for outcome in compare.unreached if kinds[outcome] == kind]
        if missed:
            failures.append(
                f"{label} coverage: required {kind}s never reached: {', '.join(missed)}"
            )
    if compare.unexpected:
        failures.append(
            "decision coverage: outcomes the catalog marks unreachable (or does not list) were "
            f"reached: {', '.join(compare.unexpected)}; the catalog's reason no longer holds"
        )
    return failures


def _run_counters(result: RunResult) -> dict[str, int]:
    return {name: result.summary()[name] for name in SAME_RUN_COUNTERS}


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def first_line(error: BaseException) -> str:
    """The check's own message (pytest appends its assert rewrite on later lines)."""
    return str(error).partition("\n")[0]


def no_eviction_pool(workload: Workload, dtype: str) -> dict:
    """Cache fields for a pool that holds every request at full length at once, above the watermark.

    No host pages: a run that never evicts never uses them.
    """
    cache = workload.cache
    num_needed = sum(
        pages_needed(len(r.prompt_ids) + r.max_new_tokens, cache.page_size)
        for r in workload.requests
    )
    num_pages = num_needed
    while num_pages - watermark_pages(cache.watermark, num_pages) < num_needed:
        num_pages += 1
    return {"num_gpu_pages": num_pages, "num_host_pages": 0, "dtype": dtype}


def _describe(record: DivergenceRecord | None) -> str:
    """``op step N, kind at path, path (+k more)``: one divergence on one line."""
    if record is None:
        return "not in the log"
    where = f"{record.op} step {record.step}, {record.kind}"
    if not record.field_paths:
        return f"{where}: {record.exception}"
    more = len(record.field_paths) - _MAX_NAMED_PATHS
    return f"{where} at {', '.join(record.field_paths[:_MAX_NAMED_PATHS])}" + (
        f" (+{more} more)" if more > 0 else ""
    )
