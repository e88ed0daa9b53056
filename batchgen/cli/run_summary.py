"""What ``batchgen run`` prints when the run ends: its summary (a table, or one JSON object), and a
warning naming the requests that failed."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from batchgen.cli.common import (
    context,
)
from batchgen.cli.run_flags import applied_scale
from batchgen.engine.runner import RunResult
from batchgen.engine.worker import Worker
from batchgen.shadow.coverage import unreached_outcomes
from batchgen.state import ABORT_REASON, Phase
from compare import RunSummary


def warn_failed_requests(result: RunResult) -> None:
    """A warning on stderr when requests failed: how many, and each failure with its count."""
    reasons = Counter(
        output.finish_reason for output in result.outputs.values() if output.phase is Phase.FAILED
    )
    if reasons:
        num_failed, why = (
            sum(reasons.values()),
            ", ".join(f"{reason} ({n})" for reason, n in reasons.most_common()),
        )
        print(
            f"batchgen: warning: {num_failed} of {len(result.outputs)} requests failed: {why}; the"
            " run still exits 0 (failed_requests counts them, --outputs names each)",
            file=sys.stderr,
        )


def _request_outcomes(result: RunResult) -> dict[str, int]:
    """How the workload's requests ended: finished (length or eos), aborted (finished by an abort),
    failed. Pure."""
    outputs = result.outputs.values()
    num_failed = sum(output.phase is Phase.FAILED for output in outputs)
    num_aborted = sum(
        output.phase is Phase.FINISHED and output.finish_reason == ABORT_REASON
        for output in outputs
    )
    return {
        "finished_requests": len(outputs) - num_failed - num_aborted,
        "aborted_requests": num_aborted,
        "failed_requests": num_failed,
    }


def _production_limits(gate, worker: Worker) -> dict:
    """Compare mode's budget and breaker as the run ended: the limits, the sample rate, and the
    step the breaker opened at (None: it did not). Pure."""
    governor = worker.kv_compare.governor
    return {
        "kv_compare_budget": gate.compare_budget,
        "kv_breaker_errors": gate.compare_breaker_errors,
        "kv_breaker_seconds": gate.compare_breaker_seconds,
        "kv_sample_rate_end": worker.kv_compare.executor.sample_rate,
        "kv_breaker_step": governor.breaker_step if governor is not None else None,
    }


def _compare_counts(compared: RunSummary, worker: Worker) -> dict:
    """Compare mode's part of the summary: its gates, what it compared and found, the decisions
    it reached, and its budget and breaker. Pure."""
    gate = worker.kv_gate
    return {
        "kv_shadow_path": compared.shadow,
        "kv_compare_sample": gate.compare_sample,
        "kv_compare_ops": list(gate.compare_ops),
        "steps_compared": dict(compared.steps_compared),
        "divergences": sum(compared.divergences.values()),
        "divergences_by_op": dict(compared.divergences),
        "harness_errors": compared.harness_errors,
        "coverage": {outcome: tally.model_dump() for outcome, tally in compared.coverage.items()},
        "coverage_unreached": list(unreached_outcomes(compared)),
        "compare_log": gate.compare_log,
        **_production_limits(gate, worker),
    }


def run_summary(
    result: RunResult, worker: Worker, args: argparse.Namespace, faults: str | None
) -> dict:
    """The run's counters (requests by outcome after their total), what it ran on, its KV path,
    compare counts and decision coverage (compare mode) and the fault SPEC it ran under."""
    gate, engine = worker.kv_gate, worker.engine_config
    counters = result.summary()
    requests = {"requests": counters.pop("requests"), **_request_outcomes(result)}
    applied = context(args, dtype=worker.cache_config.dtype, scale=applied_scale(args))
    summary = {
        "workload": counters.pop("workload"),
        **requests,
        **counters,
        "live_requests": result.live_requests,
        **applied,
        "kv_path": gate.path,
        "kv_compare": gate.compare,
        "kv_verify": gate.verify,
        "max_load_retries": engine.max_load_retries,
        "load_timeout_steps": engine.load_timeout_steps,
        "load_failure": engine.load_failure,
        "schedule_policy": engine.schedule_policy,
    }
    if result.compare_summary is not None:
        summary |= _compare_counts(result.compare_summary, worker)
    if worker.kv_verify is not None:  # the page-content oracle's counts, and where it logs
        data = worker.kv_verify.summary()
        summary |= {
            "data_checked": data.checked,
            "data_divergences": sum(data.divergences.values()),
            "copy_patterns": data.patterns,
            "compare_log": gate.compare_log,
        }
    if worker.faults is not None:
        summary |= {"faults": faults, "fault_aborts": worker.faults.num_aborts}
    return summary
