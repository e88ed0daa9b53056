"""Where a command's metrics go: ``/metrics`` over HTTP while it runs, a text-format file at the
end (written atomically, for node-exporter's textfile collector)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import generate_latest, start_http_server

from batchgen.metrics.config import MetricsConfig, MetricsConfigError
from batchgen.metrics.worker_metrics import WorkerMetrics
from compare import write_atomic


@contextmanager
def exporting(config: MetricsConfig, make_metrics=WorkerMetrics) -> Iterator[WorkerMetrics | None]:
    """The command's metrics (None when ``config`` asks for neither a server nor a file; else
    ``make_metrics()``: a WorkerMetrics, or another object with a ``registry`` and a ``port``),
    served on ``config.host``:``config.port`` while the block runs (one line on stderr names the
    URL) and written to ``config.file`` when it ends, however it ends. MetricsConfigError when the
    port cannot be bound. Mutates the file system and starts (then stops) a server thread."""
    if not config.enabled:
        yield None
        return
    metrics = make_metrics()
    server = thread = None
    if config.port is not None:
        try:
            server, thread = start_http_server(
                config.port, addr=config.host, registry=metrics.registry
            )
        except OSError as error:
            raise MetricsConfigError(
                f"--metrics-port {config.port}: cannot serve on {config.host}:{config.port}:"
                f" {error.strerror or error}"
            ) from None
        metrics.port = server.server_port  # the one bound, for port 0
        print(
            f"batchgen: metrics on http://{config.host}:{metrics.port}/metrics",
            file=sys.stderr,
        )
    try:
        yield metrics
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
            thread.join()
        if config.file is not None:
            write_metrics_file(config.file, metrics)


def write_metrics_file(path: str, metrics: WorkerMetrics) -> None:
    """Replace ``path`` with the metrics' values in Prometheus' text format. Mutates the file."""
    write_atomic(path, generate_latest(metrics.registry).decode())
