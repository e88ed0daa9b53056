"""The report of ``bench.py compare``: each goal's verdict, and the tables of both parts."""

from __future__ import annotations

import argparse

from rich.table import Table

from .compare_bookkeeping import LABELS, QUIET, VARIANTS
from .compare_end_to_end import e2e_table

GOALS = {"end_to_end": 1.05, "coverage": 1.05, "quiet_harness_growth": 2.0}
GOAL_NAMES = {
    "end_to_end": "end to end, compare on / off",
    "coverage": "coverage classification: compare / coverage off, worst N",
    "quiet_harness_growth": "harness on quiet steps (<= 4 touched), largest N / smallest N",
}


def goal(value: float | None, at: str, key: str) -> dict:
    """``met`` is None when there is no value to judge. Pure."""
    met = None if value is None else value <= GOALS[key]
    return {"value": value, "at": at, "goal": GOALS[key], "met": met}


def verdicts(sizes: list[dict], touched: list[dict], e2e: dict | None) -> dict:
    """Each goal's measured ratio, where it was worst, its target, and whether it was met. The
    quiet-step growth has no value when a quiet harness is <= 0: compare - plan - legacy is then
    within the noise of its three terms, and a ratio of it means nothing. Pure."""
    out = {}
    if e2e is not None:
        out["end_to_end"] = goal(e2e["ratio"], f"L2-4096, {e2e['basis']}", "end_to_end")
    worst = max(sizes, key=lambda row: row["coverage_ratio"])
    out["coverage"] = goal(worst["coverage_ratio"], f"N = {worst['num_requests']}", "coverage")
    quiet = {row["num_requests"]: row["harness_us"] for row in touched if row["touched"] == QUIET}
    if len(quiet) >= 2:
        small, large = min(quiet), max(quiet)
        at, growth = f"N = {large} vs {small}", None
        if quiet[small] > 0 and quiet[large] > 0:
            growth = quiet[large] / quiet[small]
        else:
            at += ": a harness <= 0, within the noise"
        out["quiet_harness_growth"] = goal(growth, at, "quiet_harness_growth")
    return out


def sizes_table(sizes: list[dict], args: argparse.Namespace) -> Table:
    names = [LABELS.get(v, v) for v in VARIANTS]
    title = (
        f"KV bookkeeping, us per step (mean over {args.steps} steps of each step's minimum over"
        f" {args.repeats} interleaved runs); harness = compare - plan - legacy"
    )
    columns = ("N", "alive", "touched", *names, "harness", "compare / coverage off")
    table = Table(*columns, title=title)
    for r in sizes:
        table.add_row(
            str(r["num_requests"]),
            f"{r['mean_alive']:.0f}",
            f"{r['mean_touched']:.1f}",
            *(f"{r[f'{v}_us_per_step']:.0f}" for v in VARIANTS),
            f"{r['harness_us_per_step']:.0f}",
            f"{r['coverage_ratio']:.3f}x",
        )
    return table


def touched_table(touched: list[dict]) -> Table:
    names = [LABELS.get(v, v) for v in VARIANTS]
    title = "By requests touched: us per step, medians over the steps in each bucket"
    table = Table("N", "touched", "steps", *names, "harness", title=title)
    for r in touched:
        table.add_row(
            str(r["num_requests"]),
            r["touched"],
            str(r["num_steps"]),
            *(f"{r[f'{v}_us']:.0f}" for v in VARIANTS),
            f"{r['harness_us']:.0f}",
        )
    return table


def goals_table(results: dict) -> Table:
    table = Table("goal", "measured", "at", "target", "verdict", title="Goals")
    for key, v in results.items():
        verdict = {True: "met", False: "MISSED", None: "no verdict"}[v["met"]]
        measured = "-" if v["value"] is None else f"{v['value']:.3f}x"
        table.add_row(GOAL_NAMES[key], measured, v["at"], f"<= {v['goal']}x", verdict)
    return table


def tables(sizes, touched, e2e, results, args) -> list[Table]:
    """The report's tables: per size, per touched bucket, end to end, goals. Pure."""
    out = [sizes_table(sizes, args), touched_table(touched)]
    if e2e is not None:
        out.append(e2e_table(e2e))
    return [*out, goals_table(results)]
