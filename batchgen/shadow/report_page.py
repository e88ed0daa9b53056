"""The KV binding of the HTML report (``compare.html``): what each run's chart shows, from the
timeline the runner records (``batchgen.engine.timeline``), and how a divergence is replayed.
"""

from __future__ import annotations

from collections.abc import Sequence

from compare import LogRecord, Report
from compare.charts import Panel
from compare.html import PageBinding, render_html

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


def render_page(report: Report, logs: Sequence[tuple[str, Sequence[LogRecord]]]) -> str:
    """The HTML page of ``report`` and the runs of ``logs`` (each: its path, its records). Pure."""
    return render_html(report, logs, KV_PAGE)
