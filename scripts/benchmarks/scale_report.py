"""The report of ``bench.py scale``: per mode, step and KV-op times, pages, the resident set, and
where a step goes.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .scale_run import PHASES


def results_table(results: list[dict], max_ratio: float) -> Table:
    first = next((r for r in results if "error" not in r), None)
    title = "scale check"
    if first is not None:
        title += (
            f": {first['num_requests']} requests, {first['num_gpu_pages']:,} GPU /"
            f" {first['num_host_pages']:,} host pages, {first['num_steps']} steps per mode"
        )
    columns = ("mode", "step ms\nmean/p50/p99", "KV ms\n/step", "client\nms/step")
    columns += ("served\n/step", "evict / load /\nrecompute", "GPU pages\nused (mean)")
    columns += ("host pages\nused (mean)", "RSS MiB\nfirst -> last", "RSS\nratio", "integrity")
    table = Table(*columns, "CPU s /\nwall s", title=title)
    for r in results:
        if "error" in r:
            table.add_row(r["mode"], f"[red]FAILED: {r['error']}[/red]")
            continue
        step, rss = r["step_ms"], r["rss_mib"]
        color = "green" if r["rss_ratio"] <= max_ratio else "red"
        table.add_row(
            r["mode"],
            f"{step['mean']:.0f} / {step['p50']:.0f} / {step['p99']:.0f}",
            f"{r['kv_ms_per_step']:.1f}",
            f"{r['client_ms_per_step']:.1f}",
            f"{r['served_per_step']:,.0f}",
            f"{r['evictions']:,} / {r['loads']:,} / {r['recompute_preemptions']:,}",
            f"{r['gpu_pages_used']['mean']:,.0f}",
            f"{r['host_pages_used']['mean']:,.0f}",
            f"{rss[str(r['rss_from_step'])]:.1f} -> {rss[str(r['num_steps'])]:.1f}",
            f"[{color}]{r['rss_ratio']:.4f}[/]",
            r["integrity"],
            f"{r['cpu_s']:.0f} / {r['run_s']:.0f}",
        )
    return table


def phases_table(results: list[dict]) -> Table:
    names = [*PHASES, "other", "gc"]
    title = (
        "where a step goes: ms per step (gc: collections inside the phases, counted in them too)"
    )
    table = Table("mode", *names, title=title)
    for r in results:
        if "error" not in r:
            table.add_row(r["mode"], *(f"{r['phase_ms_per_step'][name]:.1f}" for name in names))
    return table


def print_report(results: list[dict], max_ratio: float) -> None:
    console = Console(width=160)
    console.print(results_table(results, max_ratio))
    console.print(phases_table(results))
    for r in results:
        if "compare" in r:
            c = r["compare"]
            console.print(
                f"{r['mode']}: {sum(c['steps_compared'].values()):,} ops compared,"
                f" {sum(c['divergences'].values())} divergences, {c['harness_errors']} harness"
                " errors"
            )
