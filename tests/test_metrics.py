"""Prometheus metrics: ``/metrics`` scraped over HTTP during a real run and parsed with
prometheus-client's own parser; counters equal the run's summary; a divergence shows while the run
still goes; ``BATCHGEN_METRICS_*`` parsed like the KV gates; the final file written whole."""

from __future__ import annotations

import urllib.request

import pytest
from injected_bugs import reversed_grants
from prometheus_client.parser import text_string_to_metric_families

from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import run_workload
from batchgen.engine.workloads import load_workload
from batchgen.kv.gate import KvGateConfig
from batchgen.metrics.config import MetricsConfig, MetricsConfigError, metrics_config
from batchgen.metrics.exporter import exporting
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker
from compare import RunSummary, read_log


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """``/metrics`` on 127.0.0.1:``port``, parsed: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    """The samples of ``name`` keyed by their ``label``'s value. Pure."""
    return {
        dict(labels)[label]: value for (sample, labels), value in samples.items() if sample == name
    }


def smoke_worker(tiny, log, faults="seed=2,load_fail=0.3"):
    workload = load_workload("smoke", vocab_size=tiny.config.vocab_size)
    worker = gated_worker(
        tiny, cache_config=workload.cache, engine_config=workload.engine,
        kv_gate=KvGateConfig(compare="log", compare_log=str(log)),
        faults=FaultInjector(FaultSpec.parse(faults)),
    )  # fmt: skip
    return worker, workload


def test_scraped_counters_equal_the_run_summary_at_the_end(tiny, tmp_path):
    worker, workload = smoke_worker(tiny, tmp_path / "log.jsonl")
    with exporting(MetricsConfig(port=0)) as metrics:
        result = run_workload(worker, workload, metrics=metrics)
        samples = scrape(metrics.port)
    summary, stats, w = result.compare_summary, result.stats, ("workload", "smoke")
    assert by_label(samples, "batchgen:kv_compare_ops_total", "op") == {
        op: float(summary.steps_compared.get(op, 0)) for op in KvGateConfig().compare_ops
    }
    assert samples[("batchgen:kv_compare_harness_errors_total", (w,))] == summary.harness_errors
    assert samples[("batchgen:kv_compare_seconds_total", (w,))] == pytest.approx(
        summary.compare_seconds
    )
    assert by_label(samples, "batchgen:kv_decision_outcomes_total", "outcome") == {
        outcome: float(tally.count) for outcome, tally in summary.coverage.items()
    }
    assert samples[("batchgen:evictions_total", (w,))] == stats.evictions > 0
    assert samples[("batchgen:loads_total", (w,))] == stats.loads > 0
    assert samples[("batchgen:load_failures_total", (w,))] == stats.load_failures
    assert samples[("batchgen:num_preemptions_total", (w,))] == stats.recompute_preemptions
    assert samples[("batchgen:generation_tokens_total", (w,))] == stats.tokens_generated
    # smoke's cache config leaves prefix caching off: the series are there, at 0
    assert samples[("batchgen:prefix_cache_queries_total", (w,))] == 0
    assert samples[("batchgen:prefix_cache_hits_total", (w,))] == 0
    host = worker.host_kv  # every eviction stored pages, every load that ran copied some back
    for direction, num_pages in host.pages_copied.items():
        labels = (("direction", direction), w)
        assert samples[("batchgen:kv_offload_bytes_total", labels)] == num_pages * host.page_bytes
        assert samples[("batchgen:kv_offload_seconds_total", labels)] == pytest.approx(
            host.copy_seconds[direction]
        )
    assert host.pages_copied["gpu_to_host"] >= stats.evictions > 0
    assert host.page_bytes == tiny.config.num_layers * 2 * workload.cache.page_size * (
        tiny.config.num_kv_heads * tiny.config.head_dim * 4
    )
    prompts = sum(len(r.prompt_ids) for r in workload.requests)
    assert samples[("batchgen:prompt_tokens_total", (w,))] == prompts
    assert samples[("batchgen:step_duration_seconds_count", (w,))] == result.num_steps
    num_requests = len(workload.requests)
    assert samples[("batchgen:e2e_request_latency_seconds_count", (w,))] == num_requests
    assert samples[("batchgen:time_to_first_token_seconds_count", (w,))] == num_requests
    # the run is over: nothing live, nothing held; compare mode still compares every step
    assert samples[("batchgen:num_requests_running", (w,))] == 0
    assert samples[("batchgen:gpu_kv_usage_perc", (w,))] == 0
    assert samples[("batchgen:kv_compare_sample_rate", (w,))] == 1.0
    assert samples[("batchgen:kv_compare_breaker_open", (w,))] == 0
    assert set(by_label(samples, "batchgen:kv_compare_divergences_total", "kind").values()) == {0.0}


def test_the_prefix_cache_counters_count_the_tokens_the_run_looked_up_and_hit(tiny):
    workload = load_workload("shared-prefix", scale=0.25, vocab_size=tiny.config.vocab_size)
    worker = gated_worker(
        tiny, cache_config=workload.cache, engine_config=workload.engine, kv_gate=KvGateConfig()
    )
    with exporting(MetricsConfig(port=0)) as metrics:
        result = run_workload(worker, workload, metrics=metrics)
        samples = scrape(metrics.port)
    w, stats = (("workload", "shared-prefix"),), result.stats
    assert samples[("batchgen:prefix_cache_queries_total", w)] == stats.prefix_cache_queries > 0
    assert samples[("batchgen:prefix_cache_hits_total", w)] == stats.prefix_cache_hits > 0
    assert result.summary()["prefix_cache_hits"] == stats.prefix_cache_hits


def test_an_injected_divergence_shows_on_the_metric_while_the_run_goes_on(
    tiny, tmp_path, monkeypatch
):
    reversed_grants(monkeypatch)  # alloc divergences from the first step needing two pages
    worker, workload = smoke_worker(tiny, tmp_path / "log.jsonl")
    seen = []  # (step, divergences scraped, requests live) after each step
    key = ("batchgen:kv_compare_divergences_total", (("kind", "state"), ("op", "alloc"),
                                                      ("workload", "smoke")))  # fmt: skip
    with exporting(MetricsConfig(port=0)) as metrics:

        def scrape_each_step(num_released, num_requests):
            samples = scrape(metrics.port)
            seen.append((worker.state.step, samples[key], num_requests - num_released))

        result = run_workload(worker, workload, metrics=metrics, on_step=scrape_each_step)
    diverged = result.compare_summary.divergences["alloc"]
    assert diverged > 1
    first = next(i for i, (_, count, _) in enumerate(seen) if count > 0)
    assert seen[first][2] > 0  # requests still live: the run was going on
    assert seen[-1][1] == diverged
    assert [count for _, count, _ in seen] == sorted(count for _, count, _ in seen)


def test_the_final_values_go_to_the_metrics_file_in_the_text_format(tiny, tmp_path):
    worker, workload = smoke_worker(tiny, tmp_path / "log.jsonl")
    path = tmp_path / "textfile" / "batchgen.prom"
    with exporting(MetricsConfig(file=str(path))) as metrics:
        result = run_workload(worker, workload, metrics=metrics)
        assert not path.exists()  # written when the command ends
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(path.read_text())
        for sample in family.samples
    }
    tokens = samples[("batchgen:generation_tokens_total", (("workload", "smoke"),))]
    assert tokens == result.stats.tokens_generated
    assert [p.name for p in path.parent.iterdir()] == ["batchgen.prom"]  # no temp file left


# ---- BATCHGEN_METRICS_* ------------------------------------------------------------------------
def test_the_metrics_settings_default_to_nothing_served_on_this_machine_only():
    config = metrics_config({})
    assert (config.port, config.host, config.file, config.enabled) == (
        None,
        "127.0.0.1",
        None,
        False,
    )


def test_an_option_overrides_the_environment():
    environ = {"BATCHGEN_METRICS_PORT": "9100", "BATCHGEN_METRICS_HOST": "0.0.0.0"}
    assert metrics_config(environ).port == 9100
    config = metrics_config(environ, {"port": "9200", "host": None, "file": "m.prom"})
    assert (config.port, config.host, config.file) == (9200, "0.0.0.0", "m.prom")


def test_a_misspelt_metrics_variable_is_refused_naming_the_closest():
    with pytest.raises(MetricsConfigError, match=r"BATCHGEN_METRICS_PROT \(did you mean"
                       r" BATCHGEN_METRICS_PORT\?\)"):  # fmt: skip
        metrics_config({"BATCHGEN_METRICS_PROT": "9100"})


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_a_bad_port_is_refused_naming_the_variable_and_what_is_allowed(port):
    with pytest.raises(MetricsConfigError) as raised:
        metrics_config({"BATCHGEN_METRICS_PORT": port})
    assert str(raised.value).startswith(f"BATCHGEN_METRICS_PORT={port!r} is invalid")
    assert "allowed: a port number, 0 to 65535" in str(raised.value)


def test_a_bad_environment_value_is_refused_even_where_an_option_overrides_it():
    with pytest.raises(MetricsConfigError, match="BATCHGEN_METRICS_PORT='x'"):
        metrics_config({"BATCHGEN_METRICS_PORT": "x"}, {"port": "9100"})


def test_a_port_in_use_is_a_clear_error(tiny):
    with exporting(MetricsConfig(port=0)) as metrics:
        with pytest.raises(
            MetricsConfigError, match=f"--metrics-port {metrics.port}: cannot serve"
        ):
            with exporting(MetricsConfig(port=metrics.port)):
                pass


# ---- sweep and validate ------------------------------------------------------------------------
def test_a_sweep_serves_the_sums_of_its_finished_runs(tmp_path):
    from sweep_tasks import run_with_reversed_grants

    from batchgen.sweep.backends import ProcessBackend
    from batchgen.sweep.driver import run_sweep
    from batchgen.sweep.matrix import sweep_cells, sweep_directions, sweep_workloads

    cells = sweep_cells(
        sweep_workloads(["smoke"]), (0, 1), (None,), sweep_directions("both", aa_check=False)
    )
    with exporting(MetricsConfig(port=0)) as metrics, ProcessBackend(1) as backend:
        result = run_sweep(
            cells, backend, run=run_with_reversed_grants, reports_dir=tmp_path,
            on_run=metrics.add_run,
        )  # fmt: skip
        samples = scrape(metrics.port)
    compare = result.compare
    diverged = {}
    for (name, labels), value in samples.items():
        if name == "batchgen:kv_compare_divergences_total":
            op = dict(labels)["op"]
            diverged[op] = diverged.get(op, 0) + value
    assert diverged == {s.op: float(s.num_divergences) for s in compare.ops if s.num_divergences}
    compared = {}
    for (name, labels), value in samples.items():
        if name == "batchgen:kv_compare_ops_total":
            compared[dict(labels)["op"]] = compared.get(dict(labels)["op"], 0) + value
    assert compared == {s.op: float(s.num_compared) for s in compare.ops}
    assert sum(diverged.values()) > 0
    evictions = sum(v for (n, _), v in samples.items() if n == "batchgen:evictions_total")
    runs = [r for r in read_log(result.reports["jsonl"]).records if isinstance(r, RunSummary)]
    assert len(runs) == len(cells)
    assert evictions == sum(sum(run.timeline.counters["evictions"]) for run in runs) > 0


def test_validate_counts_over_all_its_runs_labelled_by_workload(tiny, tmp_path, monkeypatch):
    from test_validation import pressure_workload, use_workloads

    from batchgen.kv.gate import KV_OPS
    from batchgen.validation.validate import validate_back_to_back

    use_workloads(monkeypatch, tmp_path, pressure_workload("pa", seed=1), pressure_workload("pb"))
    path = tmp_path / "validate.prom"
    with exporting(MetricsConfig(file=str(path))) as metrics:
        report = validate_back_to_back(tiny, metrics=metrics, reports_dir=tmp_path / "reports")
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(path.read_text())
        for sample in family.samples
    }
    compared: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == "batchgen:kv_compare_ops_total":
            workload = dict(labels)["workload"]
            compared[workload] = compared.get(workload, 0) + value
    compare_runs = [run for run in report.runs if run.shadow_path is not None]
    assert len(compared) == len(compare_runs) > 2  # one label per compare run: workload, direction
    kv_ops = [op for op in report.compare.ops if op.op in KV_OPS]  # the finish slice's apart
    assert sum(compared.values()) == sum(op.num_compared for op in kv_ops)
    tokens = sum(v for (n, _), v in samples.items() if n == "batchgen:generation_tokens_total")
    assert tokens == sum(run.summary["tokens_generated"] for run in report.runs)
