"""Prometheus metrics of a batchgen command: ``config`` (``BATCHGEN_METRICS_*`` and the
``--metrics-*`` options), ``worker_metrics`` (the metric families, in a registry of their own),
``live`` (one run as the metrics read it), ``exporter`` (``/metrics`` while the command runs, the
final values in a file)."""
