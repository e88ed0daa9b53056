"""Migration copy bandwidth: offload a batch of KV pages to the host pool, then reload it.

Every variant moves the same bytes (``--pages`` pages each way) and is timed in
the same run, interleaved, ``--repeats`` times; the table shows median GiB/s and
the ratio to the raw contiguous copy measured alongside it:

    raw                 dst_block.copy_(src_block): equally sized contiguous slices
    consecutive         copy_pages, ids 0..pages-1 on both sides (fresh pools)
    scattered GPU ids   copy_pages, GPU ids scattered over the pool, host ids consecutive
    shuffled both       copy_pages, ids scattered and shuffled on both sides
    per-page loop       dst[d].copy_(src[s]) per page, ids as in "shuffled both"

The page is the ``tiny`` model's (2 KV heads, head_dim 16, 16 tokens, float32)
with ``num_layers`` scaled until a page is ``--page-kib`` KiB. Pools hold twice
the batch so scattered ids have room. On ``--device cuda`` the GPU pool is on
the device and the host pool pinned (raw = a pinned host <-> device copy), timed
with CUDA events; on ``cpu`` both pools are host memory.

    python scripts/bench.py migration --json-out bench_migration.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from batchgen.config import TINY_MODELS
from batchgen.kv.page_copy import copy_pages, new_page_tensor
from batchgen.model.loader import host_memory_available
from batchgen.model.paged_kv import kv_page_shape

from .ab_timer import interleaved
from .output_path import output_path, write_output

PAGE_SIZE = 16
DTYPE = torch.float32


@dataclass(frozen=True, slots=True)
class Variant:
    """One way to move the batch: ``offload`` GPU pool -> host pool, ``reload`` back."""

    name: str
    offload: Callable[[], None]
    reload: Callable[[], None]


def parse_args(argv: list[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog="Variants are measured interleaved in one run; compare ratios, not absolute GiB/s.",
    )
    parser.add_argument("--pages", type=int, default=1024, help="pages per batch (default 1024)")
    parser.add_argument(
        "--page-kib", type=int, default=128, help="page size in KiB, a multiple of 4 (default 128)"
    )
    parser.add_argument(
        "--repeats", type=int, default=9, help="timed repeats per variant, median shown (default 9)"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the GPU pool is (default cpu)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for the scattered ids (default 0)"
    )
    parser.add_argument(
        "--json-out", type=output_path, help="write the figures as JSON to this path"
    )
    args = parser.parse_args(argv)
    if args.pages < 1 or args.repeats < 1:
        parser.error("--pages and --repeats must be >= 1")
    if args.page_kib <= 0 or args.page_kib % 4:
        parser.error(
            "--page-kib must be a positive multiple of 4 (one layer of the tiny page is 4 KiB)"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs CUDA, which this machine lacks")
    # pools of 2 x --pages
    host_bytes = (4 if args.device == "cpu" else 2) * args.pages * args.page_kib * 1024
    available = host_memory_available()
    if available is not None and host_bytes > available:
        parser.error(
            f"--pages {args.pages} x --page-kib {args.page_kib} needs {host_bytes / 2**30:.1f} GiB"
            f" of host memory for its pools; {available / 2**30:.1f} GiB is available"
        )
    return args


def page_shape(page_kib: int, num_pages: int) -> tuple[int, ...]:
    """The tiny model's pool shape with ``num_layers`` scaled to make a page ``page_kib`` KiB."""
    tiny = TINY_MODELS["tiny"]
    layer_bytes = 2 * PAGE_SIZE * tiny.num_kv_heads * tiny.head_dim * DTYPE.itemsize
    scaled = tiny.model_copy(update={"num_layers": page_kib * 1024 // layer_bytes})
    return kv_page_shape(scaled, PAGE_SIZE, num_pages)


def build_variants(
    gpu_pool: torch.Tensor, host_pool: torch.Tensor, num_pages: int, seed: int
) -> list[Variant]:
    """The compared variants over the two pools; each call of theirs overwrites pages of one
    pool."""
    rng = random.Random(seed)
    consecutive = list(range(num_pages))
    scattered_gpu_ids = rng.sample(range(len(gpu_pool)), num_pages)
    scattered_host_ids = rng.sample(range(len(host_pool)), num_pages)

    def raw(src: torch.Tensor, dst: torch.Tensor) -> Callable[[], None]:
        return lambda: dst[:num_pages].copy_(src[:num_pages], non_blocking=True)

    def paged(src, src_ids, dst, dst_ids) -> Callable[[], None]:
        return lambda: copy_pages(src, src_ids, dst, dst_ids)

    def per_page(src, src_ids, dst, dst_ids) -> Callable[[], None]:
        def loop() -> None:
            for src_id, dst_id in zip(src_ids, dst_ids):
                dst[dst_id].copy_(src[src_id], non_blocking=True)

        return loop

    return [
        Variant("raw", raw(gpu_pool, host_pool), raw(host_pool, gpu_pool)),
        Variant(
            "consecutive",
            paged(gpu_pool, consecutive, host_pool, consecutive),
            paged(host_pool, consecutive, gpu_pool, consecutive),
        ),
        Variant(
            "scattered GPU ids",
            paged(gpu_pool, scattered_gpu_ids, host_pool, consecutive),
            paged(host_pool, consecutive, gpu_pool, scattered_gpu_ids),
        ),
        Variant(
            "shuffled both",
            paged(gpu_pool, scattered_gpu_ids, host_pool, scattered_host_ids),
            paged(host_pool, scattered_host_ids, gpu_pool, scattered_gpu_ids),
        ),
        Variant(
            "per-page loop",
            per_page(gpu_pool, scattered_gpu_ids, host_pool, scattered_host_ids),
            per_page(host_pool, scattered_host_ids, gpu_pool, scattered_gpu_ids),
        ),
    ]


def seconds(copy: Callable[[], None], device: str) -> float:
    """Wall time of one ``copy`` until its bytes have landed."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        copy()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000
    started = time.perf_counter()
    copy()
    return time.perf_counter() - started


def measure(
    variants: list[Variant], repeats: int, device: str
) -> dict[str, dict[str, list[float]]]:
    """Seconds per variant and direction; variants interleaved, order rotated each repeat."""
    for variant in variants:  # warm-up: first touch of the pools, lazy inits
        variant.offload()
        variant.reload()
    by_name = {variant.name: variant for variant in variants}

    def run(name: str) -> tuple[float, float]:
        return seconds(by_name[name].offload, device), seconds(by_name[name].reload, device)

    samples = interleaved(list(by_name), repeats, run)
    return {
        name: {"offload": [run[0] for run in runs], "reload": [run[1] for run in runs]}
        for name, runs in samples.items()
    }


def summarise(timings: dict[str, dict[str, list[float]]], batch_bytes: int) -> list[dict]:
    """Median seconds, GiB/s and ratio to raw per variant and direction."""
    raw = {
        direction: statistics.median(timings["raw"][direction])
        for direction in ("offload", "reload")
    }
    rows = []
    for name, by_direction in timings.items():
        row: dict = {"variant": name}
        for direction, samples in by_direction.items():
            median = statistics.median(samples)
            row[f"{direction}_median_s"] = median
            row[f"{direction}_gib_s"] = batch_bytes / median / 2**30
            row[f"{direction}_ratio_vs_raw"] = raw[direction] / median
        rows.append(row)
    return rows


def machine_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{os.cpu_count()}-core {platform.machine()} CPU"


def render(rows: list[dict], title: str) -> Table:
    """The figures as a rich table: GiB/s and ratio to raw, per direction."""
    table = Table(title=title)
    for column in ("variant", "offload GiB/s", "reload GiB/s", "offload / raw", "reload / raw"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for row in rows:
        table.add_row(
            row["variant"],
            f"{row['offload_gib_s']:.2f}",
            f"{row['reload_gib_s']:.2f}",
            f"{row['offload_ratio_vs_raw']:.2f}",
            f"{row['reload_ratio_vs_raw']:.2f}",
        )
    return table


def main(argv: list[str], prog: str) -> int:
    args = parse_args(argv, prog)
    pool_shape = page_shape(args.page_kib, 2 * args.pages)
    gpu_pool = torch.randn(pool_shape, dtype=DTYPE, device=args.device)
    host_pool = new_page_tensor(
        pool_shape, dtype=DTYPE, device="cpu", pin_memory=args.device == "cuda"
    )
    page_bytes = gpu_pool[0].numel() * gpu_pool.element_size()
    batch_bytes = args.pages * page_bytes

    timings = measure(
        build_variants(gpu_pool, host_pool, args.pages, args.seed), args.repeats, args.device
    )
    rows = summarise(timings, batch_bytes)

    title = (
        f"{args.pages} pages x {page_bytes // 1024} KiB ({page_bytes} B, page shape"
        f" {list(pool_shape[1:])}) on {args.device}, median of {args.repeats}"
    )
    Console().print(render(rows, title))
    if args.json_out:
        record = {
            "device": args.device,
            "machine": machine_name(args.device),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "load_average_1m": os.getloadavg()[0],  # others' work on a shared machine
            "pages": args.pages,
            "page_bytes": page_bytes,
            "page_shape": list(pool_shape[1:]),
            "batch_bytes": batch_bytes,
            "repeats": args.repeats,
            "seed": args.seed,
            "variants": rows,
        }
        write_output(args.json_out, json.dumps(record, indent=2) + "\n")
    return 0
