"""The report of ``bench.py kv-ops``: per (mix, size) the per-step cost of each path, their
ratio against the goal, and the cost of each KV op.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from batchgen.kv.gate import KV_OPS


def render(rows: Sequence[dict], title: str, style: box.Box) -> Table:
    columns = ("mix", "requests", "legacy us/step", "plan us/step", "plan/legacy", "goal")
    columns += ("evictions", "loads", "recomputes", "legacy x vs N0", "plan x vs N0")
    table = Table(*columns, title=title, box=style)
    first: dict[str, dict] = {}
    for row in rows:
        base = first.setdefault(row["mix"], row)
        stats = row["window_stats"]
        table.add_row(
            row["mix"],
            str(row["num_requests"]),
            f"{row['legacy_us_per_step']:.0f}",
            f"{row['plan_us_per_step']:.0f}",
            f"{row['ratio_plan_legacy']:.2f}",
            f"<= {row['goal']}x {'met' if row['met'] else 'MISSED'}",
            str(stats["evictions"]),
            str(stats["loads"]),
            str(stats["recompute_preemptions"]),
            f"{row['legacy_us_per_step'] / base['legacy_us_per_step']:.1f}",
            f"{row['plan_us_per_step'] / base['plan_us_per_step']:.1f}",
        )
    return table


def render_ops(rows: Sequence[dict], style: box.Box) -> Table:
    title = "median us/step by op (legacy / plan)"
    table = Table("mix", "requests", *KV_OPS, title=title, box=style)
    for row in rows:
        by_op = row["us_per_step_by_op"]
        table.add_row(
            row["mix"],
            str(row["num_requests"]),
            *(f"{by_op['legacy'][op]:.0f} / {by_op['plan'][op]:.0f}" for op in KV_OPS),
        )
    return table


def report(rows: list[dict], args: argparse.Namespace, console: Console, goal: float) -> None:
    style = box.MARKDOWN if args.markdown else box.HEAVY_HEAD
    title = (
        f"KV bookkeeping per step ({args.clock} clock, {args.steps} timed steps after"
        f" {args.warmup}, median of {args.repeats}, legacy and plan interleaved)"
    )
    console.print(render(rows, title, style))
    console.print(render_ops(rows, style))
    for row in rows:
        stats = row["window_stats"]
        if row["mix"] == "pressure" and not (stats["evictions"] and stats["loads"]):
            console.print(
                f"warning: pressure x {row['num_requests']}: the timed window did not both evict"
                " and migrate"
            )
    missed = [f"{row['mix']} x {row['num_requests']}" for row in rows if not row["met"]]
    console.print(
        f"goal plan/legacy <= {goal}x: "
        + ("met" if not missed else "MISSED at " + ", ".join(missed)),
        highlight=False,
    )
