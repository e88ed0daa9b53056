"""Decode attention over KV pages: the in-place kernel against padded SDPA batches.

Every case is a step's decode rows with context lengths drawn from MIN,MAX tokens over shuffled
page ids (a pool after a while of serving), attended in every layer as the model does (each batch
``plan_attention`` plans): once by the kernel reading the pages in place (``paged_decode``, what
a CPU runs in float32), once as one padded batch, once in the padded batches ``decode_groups``
cuts (what other devices run). The three run interleaved ``--repeats`` times; each figure is the
median CPU time of one step's attention over all layers, one thread.

    python scripts/bench.py decode-attention
    python scripts/bench.py decode-attention --cases 32:100-400 --kv-heads 8 --layers 16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from batchgen.config import pages_needed
from batchgen.model.paged_attention import MAX_DECODE_BATCHES, Span, plan_attention

from .ab_timer import interleaved
from .output_path import output_path, write_output

# name -> (in place, max decode batches)
VARIANTS = {"in place": (True, 1), "one batch": (False, 1), "grouped": (False, MAX_DECODE_BATCHES)}


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog="The variants are measured interleaved in one run; compare ratios.",
    )
    parser.add_argument(
        "--cases",
        default="32:16-192,16:16-384,32:100-400,64:100-1000",
        help="comma list of ROWS:MIN-MAX context tokens (default %(default)s)",
    )
    parser.add_argument("--kv-heads", type=int, default=4, help="(default 4, as 512x8)")
    parser.add_argument("--head-dim", type=int, default=64, help="(default 64)")
    parser.add_argument("--query-group", type=int, default=2, help="query heads per KV head")
    parser.add_argument("--layers", type=int, default=8, help="(default 8)")
    parser.add_argument("--page-size", type=int, default=16, help="(default 16)")
    parser.add_argument("--repeats", type=int, default=10, help="per variant (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="lengths and page ids (default 0)")
    parser.add_argument("--json-out", type=output_path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    try:
        args.case_list = [parse_case(case) for case in args.cases.split(",")]
    except ValueError:
        parser.error(f"--cases takes ROWS:MIN-MAX with 1 <= MIN <= MAX, got {args.cases!r}")
    sizes = (args.kv_heads, args.head_dim, args.query_group, args.layers, args.page_size)
    if min(*sizes, args.repeats) < 1:
        parser.error("--kv-heads, --head-dim, --query-group, --layers, --page-size, --repeats >= 1")
    return args


def parse_case(text: str) -> tuple[int, int, int]:
    """``ROWS:MIN-MAX`` -> (rows, min, max); ValueError when malformed. Pure."""
    rows, _, span = text.partition(":")
    low, _, high = span.partition("-")
    case = int(rows), int(low), int(high)
    if not 1 <= case[1] <= case[2] or case[0] < 1:
        raise ValueError(text)
    return case


def build_case(case: tuple[int, int, int], args: argparse.Namespace, rng: random.Random):
    """The case's decode spans over a shuffled page pool, the pool, and the new q/k/v."""
    num_rows, low, high = case
    lengths = [rng.randint(low, high) for _ in range(num_rows)]
    tables = [pages_needed(n + 1, args.page_size) for n in lengths]
    page_ids = list(range(sum(tables)))
    rng.shuffle(page_ids)
    spans, start = [], 0
    for row, (length, num_pages) in enumerate(zip(lengths, tables)):
        spans.append(Span(row, 1, length, page_ids[start : start + num_pages]))
        start += num_pages
    # the layout of paged_kv.kv_page_shape
    shape = (len(page_ids), args.layers, 2, args.kv_heads, args.page_size, args.head_dim)
    pages = torch.randn(shape)
    q = torch.randn(num_rows, args.kv_heads * args.query_group, args.head_dim)
    new_kv = torch.randn(2, num_rows, args.kv_heads, args.head_dim)
    return spans, pages, (q, new_kv)


def attention_step(spans, pages, q_kv, in_place: bool, max_batches: int) -> float:
    """CPU seconds of one step's decode attention in every layer, planned as the model plans it."""
    started = time.thread_time()
    plan = plan_attention(spans, pages, max_batches, in_place)
    out = torch.empty_like(q_kv[0])
    for layer in range(pages.shape[1]):
        for decodes in plan.decodes:
            decodes.attend(*q_kv, pages, layer, out)
    return time.thread_time() - started


def measure(case, args: argparse.Namespace, rng: random.Random) -> dict:
    spans, pages, q_kv = build_case(case, args, rng)
    samples = interleaved(  # the first repeat is a warm-up
        sorted(VARIANTS),
        args.repeats + 1,
        lambda name: attention_step(spans, pages, q_kv, *VARIANTS[name]),
        rotate=False,
    )
    grouped = plan_attention(spans, pages, MAX_DECODE_BATCHES, in_place=False)
    ms = {name: 1e3 * statistics.median(times[1:]) for name, times in samples.items()}
    return {
        "rows": case[0],
        "tokens": f"{case[1]}-{case[2]}",
        "batches": len(grouped.decodes),
        "ms_per_step": ms,
        "ratio": ms["grouped"] / ms["one batch"],
        "in_place_ratio": ms["in place"] / ms["grouped"],
    }


def main(argv: list[str], prog: str) -> int:
    args = parse_args(argv, prog)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    results = [measure(case, args, rng) for case in args.case_list]
    table = Table(
        title=f"decode attention, {args.layers} layers x {args.kv_heads} KV heads, 1 thread, median"
        f" of {args.repeats}"
    )
    columns = ("rows", "tokens", "batches", "one batch ms", "grouped ms", "grouped / one")
    for column in (*columns, "in place ms", "in place / grouped"):
        table.add_column(column, justify="right")
    for r in results:
        ms = r["ms_per_step"]
        table.add_row(
            str(r["rows"]),
            r["tokens"],
            str(r["batches"]),
            f"{ms['one batch']:.1f}",
            f"{ms['grouped']:.1f}",
            f"{r['ratio']:.2f}",
            f"{ms['in place']:.1f}",
            f"{r['in_place_ratio']:.2f}",
        )
    Console().print(table)
    if args.json_out:
        record = {"args": {k: v for k, v in vars(args).items() if k != "json_out"}, "rows": results}
        write_output(args.json_out, json.dumps(record, indent=2, default=str) + "\n")
    return 0
