"""The KV binding of the reports: what each run's chart shows on the HTML page (``compare.html``),
from the timeline the runner records (``batchgen.engine.timeline``), how a divergence is replayed,
and the decision catalog coverage is listed against; a log of another binding gets compare's
plain page and no catalog. ``write_reports`` renders a KV log's reports beside it (``validate``,
``sweep``): the markdown, JUnit, JSON and HTML of ``REPORT_FILES``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from batchgen.kv.gate import KV_BINDING
from batchgen.shadow.coverage import CATALOG
from compare import LogRecord, Outcome, PageBinding, Panel, Report, render_html, write_atomic
from compare.render import render_json, render_junit, render_markdown

# Report kind -> file name in the reports directory; the log comes first, the rest are rendered from
# it.
REPORT_FILES = {
    "jsonl": "divergences.jsonl",
    "md": "divergences.md",
    "junit": "divergences.xml",
    "json": "divergences.json",
    "html": "report.html",
}
_RENDERERS = {"md": render_markdown, "junit": render_junit, "json": render_json}

KV_PAGE = PageBinding(
    title="batchgen compare report",
    panels=(
        Panel("GPU pages held", ("gpu_pages",), ("gpu_capacity", "gpu_watermark")),
        Panel("host pages held", ("host_pages",), ("host_capacity",)),
        Panel("KV events per step", ("evictions", "loads", "load_failures", "recomputes")),
    ),
    labels={
        "gpu_pages": "GPU pages held",
        "gpu_capacity": "GPU pool",
        "gpu_watermark": "watermark",
        "host_pages": "host pages held",
        "host_capacity": "host pool",
        "evictions": "evictions",
        "loads": "loads",
        "load_failures": "load failures",
        "recomputes": "recomputes",
    },
    replay="batchgen replay {log} --index {index}",
)


def catalog_of(binding: str) -> tuple[Outcome, ...]:
    """The decision catalog a log of ``binding`` is reported against (another binding's: none,
    its outcomes listed as its runs reached them). Pure."""
    return CATALOG if binding == KV_BINDING else ()


def render_page(
    report: Report, logs: Sequence[tuple[str, Sequence[LogRecord]]], binding: str = KV_BINDING
) -> str:
    """The HTML page of ``report`` and the runs of ``logs`` (each: its path, its records), all of
    ``binding``: the KV page, or compare's plain page for another binding. Pure."""
    page = KV_PAGE if binding == KV_BINDING else PageBinding.plain(binding)
    return render_html(report, logs, page)


def write_reports(directory: Path, compare: Report, records: Sequence[LogRecord]) -> dict[str, str]:
    """Render ``compare``, aggregated from the log's ``records``, next to the log in
    ``directory``, each file replaced atomically; kind -> path.

    OSError naming the report (its ``filename``) that could not be written; it and the ones after it
    keep their last version."""
    log = directory / REPORT_FILES["jsonl"]
    written = {"jsonl": str(log)}
    for kind, name in REPORT_FILES.items():
        if kind == "jsonl":
            continue
        path = directory / name
        try:
            if kind == "html":
                write_atomic(path, render_page(compare, [(str(log), records)]))
            else:
                write_atomic(path, _RENDERERS[kind](compare))
        except OSError as error:
            raise OSError(error.errno, error.strerror or str(error), str(path)) from error
        written[kind] = str(path)
    return written
