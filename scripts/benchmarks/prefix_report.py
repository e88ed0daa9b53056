"""What ``bench.py prefix`` makes of its runs: each cell's figures, the ratios the goals name,
the goals' verdicts, the tokens compared, and their tables. Every function is pure.
"""

from __future__ import annotations

import statistics

from rich import box
from rich.table import Table

from batchgen.validation.output_check import NEAR_TIE_TOLERANCES

from .ab_timer import median_ratio
from .vllm_measure import compare_tokens, differing_requests

GOAL_OVER_VLLM = 1.25  # batchgen with caching on against vLLM with it on
UNIQUE_TOLERANCE = 0.02  # on the job that shares nothing, on and off within 2%
# each ratio: (its numerator's cell, its denominator's): a wall time over another
RATIOS = {
    "shared: batchgen off / on": ("shared batchgen off", "shared batchgen on"),
    "shared: vLLM off / on": ("shared vllm off", "shared vllm on"),
    "caching on: vLLM / batchgen": ("shared vllm on", "shared batchgen on"),
    "caching off: vLLM / batchgen": ("shared vllm off", "shared batchgen off"),
    "unique: batchgen off / on": ("unique batchgen off", "unique batchgen on"),
    "unique: vLLM off / on": ("unique vllm off", "unique vllm on"),
}


def summarize(measured: dict, jobs: dict, page_size: int, shared_tokens: int) -> dict:
    """Each cell's median wall and CPU seconds, its walls' spread, its prefill tokens computed and
    hit tokens (first run); each ratio of ``RATIOS`` whose cells ran (median over rounds, spread);
    the ceiling; and the shared job's unique share: one line's prompt whole, every other line's
    past the pages its shared tokens fill."""
    cells = {}
    for cell, runs in measured["runs"].items():
        walls, first = [run["wall_s"] for run in runs], measured["first"][cell]
        cells[cell] = dict(
            wall_s=statistics.median(walls), wall_min=min(walls), wall_max=max(walls)
        )
        cells[cell]["cpu_s"] = statistics.median(run["cpu_s"] for run in runs)
        cells[cell].update(prefill_tokens=first["prefill_tokens"], hit_tokens=first["hit_tokens"])
    ratios = {}
    for name, (top, bottom) in RATIOS.items():
        if top in cells and bottom in cells:
            tops, bottoms = ([run["wall_s"] for run in measured["runs"][c]] for c in (top, bottom))
            median, each = median_ratio(tops, bottoms)
            ratios[name] = dict(median=median, min=min(each), max=max(each))
    prompts = jobs["shared"].prompts
    cached = shared_tokens // page_size * page_size
    summary = dict(cells=cells, ratios=ratios, matmul_s=measured["matmul_s"])
    summary["prompt_tokens"] = sum(map(len, prompts))
    summary["unique_share"] = summary["prompt_tokens"] - (len(prompts) - 1) * cached
    if measured["matmul_s"]:
        summary["ceiling"] = cells["shared vllm on"]["wall_s"] / measured["matmul_s"]
    return summary


def verdicts(summary: dict) -> list[dict]:
    """Each goal of the issue: its name, the figures it is judged on, and "met", "missed" or
    "n/a" (its vLLM cells did not run)."""
    cells, ratios = summary["cells"], summary["ratios"]
    computed = cells["shared batchgen on"]["prefill_tokens"]
    goals = [
        goal(
            "caching on computes only the unique share",
            f"{computed} prefill tokens, unique share {summary['unique_share']}",
            computed == summary["unique_share"],
        )
    ]
    speeds = [ratios.get(name, {}).get("median") for name in list(RATIOS)[:4]]
    ours, theirs, on, off = speeds
    text = f"{ours:.2f}x against vLLM's {theirs:.2f}x" if theirs else f"{ours:.2f}x"
    goals.append(goal("shared: caching speeds batchgen >= vLLM", text, theirs and ours >= theirs))
    if on is None:
        goals.append(goal(f"caching on: >= {GOAL_OVER_VLLM}x vLLM", "no vLLM", None))
    elif summary["ceiling"] >= GOAL_OVER_VLLM:
        text = f"{on:.2f}x (ceiling {summary['ceiling']:.2f}x)"
        goals.append(goal(f"caching on: >= {GOAL_OVER_VLLM}x vLLM", text, on >= GOAL_OVER_VLLM))
    else:
        text = f"{on:.2f}x against {off:.2f}x off (ceiling {summary['ceiling']:.2f}x < 1.25x)"
        goals.append(goal("caching on: >= batchgen's ratio to vLLM off", text, on >= off))
    unique = ratios["unique: batchgen off / on"]["median"]
    within = abs(unique - 1) <= UNIQUE_TOLERANCE
    goals.append(goal("unique: caching on and off within 2%", f"{unique:.3f}x", within))
    return goals


def goal(name: str, figures: str, met: bool | None) -> dict:
    verdict = "n/a" if met is None else "met" if met else "missed"
    return dict(goal=name, figures=figures, verdict=verdict)


def check_tokens(first: dict, runs: dict) -> dict:
    """The tokens compared: batchgen on against off (both jobs), batchgen on against vLLM on and
    vLLM on against off (shared), and every run after its cell's first against it: each
    ``equal``/``near_tie``/``differing`` of ``requests`` (the near-tie rule in float32:
    ``compare_tokens``; none between runs of one engine)."""
    tolerance = NEAR_TIE_TOLERANCES["float32"]

    def compared(ours: str, theirs: str) -> dict:
        results = first[ours]["results"]
        counts = compare_tokens(results, first[theirs]["outputs"], tolerance)
        return counts | {"requests": len(results)}

    by_job = [compared(f"{job} batchgen on", f"{job} batchgen off") for job in ("shared", "unique")]
    tokens = {"batchgen on vs off": {key: sum(c[key] for c in by_job) for key in by_job[0]}}
    if "shared vllm on" in first:
        tokens["batchgen on vs vLLM on"] = compared("shared batchgen on", "shared vllm on")
        vllm = [first[f"shared vllm {switch}"]["outputs"] for switch in ("on", "off")]
        equal = len(vllm[0]) - differing_requests(*vllm)
        tokens["vLLM on vs off"] = dict(equal=equal, near_tie=0, differing=len(vllm[0]) - equal)
        tokens["vLLM on vs off"]["requests"] = len(vllm[0])
    pairs = [(run["outputs"], first[cell]["outputs"]) for cell in runs for run in runs[cell][1:]]
    num = sum(len(outputs) for outputs, _ in pairs)
    differing = sum(differing_requests(*pair) for pair in pairs)
    tokens["later runs vs their first"] = dict(equal=num - differing, near_tie=0)
    tokens["later runs vs their first"].update(differing=differing, requests=num)
    return tokens


def render(summary: dict, tokens: dict, goals: list[dict], markdown: bool) -> list[Table]:
    """The cells, the ratios, the tokens compared and the goals, as tables (Markdown boxes with
    ``markdown``)."""
    cells = Table(title="Each cell: median over rounds")
    for column in ("cell", "wall s", "spread", "CPU s", "prefill computed", "hit tokens"):
        cells.add_column(column, justify="left" if column == "cell" else "right")
    for name, cell in summary["cells"].items():
        spread = f"{cell['wall_min']:.2f}-{cell['wall_max']:.2f}"
        figures = (f"{cell['wall_s']:.2f}", spread, f"{cell['cpu_s']:.2f}")
        cells.add_row(name, *figures, str(cell["prefill_tokens"]), str(cell["hit_tokens"]))
    ratios = Table(title="Ratios of wall times: median over rounds")
    for column in ("ratio", "median", "spread"):
        ratios.add_column(column, justify="left" if column == "ratio" else "right")
    for name, ratio in summary["ratios"].items():
        ratios.add_row(name, f"{ratio['median']:.2f}x", f"{ratio['min']:.2f}-{ratio['max']:.2f}")
    compared = Table(title="Tokens: requests equal, first differing at a near-tie, otherwise")
    for column in ("compared", "requests", "equal", "near-tie", "differ"):
        compared.add_column(column, justify="left" if column == "compared" else "right")
    for name, counts in tokens.items():
        keys = ("requests", "equal", "near_tie", "differing")
        compared.add_row(name, *(str(counts[key]) for key in keys))
    verdict = Table(title="Goals")
    for column in ("goal", "figures", "verdict"):
        verdict.add_column(column)
    for row in goals:
        verdict.add_row(row["goal"], row["figures"], row["verdict"])
    tables = [cells, ratios, compared, verdict]
    for table in tables:
        table.box = box.MARKDOWN if markdown else box.HEAVY_HEAD
    return tables
