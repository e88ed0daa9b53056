"""``BATCHGEN_METRICS_*``: where a command's Prometheus metrics go, parsed like the KV gates.

Variables (``METRICS_FLAGS``)::

    BATCHGEN_METRICS_PORT   0 to 65535 (0: any free port)   default: no server
    BATCHGEN_METRICS_HOST   the address the server binds    default 127.0.0.1 (this machine only)
    BATCHGEN_METRICS_FILE   path                            default: no file

Precedence: default < environment < CLI option. An unknown ``BATCHGEN_METRICS_*`` name (a typo)
or a bad value raises :class:`MetricsConfigError` naming the variable (or option), the allowed
values and the closest valid name.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from compare.gates import check_family_names

ENV_PREFIX = "BATCHGEN_METRICS_"
# field -> (environment variable, CLI option, metavar, allowed values, what it means)
METRICS_FLAGS = {
    "port": (
        "BATCHGEN_METRICS_PORT",
        "--metrics-port",
        "PORT",
        "a port number, 0 to 65535 (0: any free port)",
        "serve Prometheus metrics on http://HOST:PORT/metrics while the command runs",
    ),
    "host": (
        "BATCHGEN_METRICS_HOST",
        "--metrics-host",
        "HOST",
        "an address to bind, e.g. 127.0.0.1 or 0.0.0.0",
        "the address --metrics-port binds (127.0.0.1: this machine only; 0.0.0.0: every interface)",
    ),
    "file": (
        "BATCHGEN_METRICS_FILE",
        "--metrics-file",
        "FILE",
        "a file path",
        "write the final metric values there in Prometheus' text format, atomically (for"
        " node-exporter's textfile collector)",
    ),
}


class MetricsConfigError(ValueError):
    """A bad ``BATCHGEN_METRICS_*`` name or value (or its CLI option)."""


class MetricsConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    port: int | None = Field(default=None, ge=0, le=65535)  # None: no server
    host: str = Field(default="127.0.0.1", min_length=1)
    file: str | None = Field(default=None, min_length=1)  # None: no file

    @field_validator("file")
    @classmethod
    def _file_is_a_file_path(cls, value: str | None) -> str | None:
        if value is not None and (value.endswith("/") or Path(value).is_dir()):
            raise ValueError(f"{value} is a directory")
        return value

    @property
    def enabled(self) -> bool:
        """Whether the command collects metrics at all (a server or a file asked for)."""
        return self.port is not None or self.file is not None


def metrics_config(
    environ: Mapping[str, str], cli: Mapping[str, object] | None = None
) -> MetricsConfig:
    """Parse ``BATCHGEN_METRICS_*`` from ``environ``, then apply CLI values (not None) on top.
    Pure."""
    known = {flag[0] for flag in METRICS_FLAGS.values()}
    check_family_names(environ, known, ENV_PREFIX, MetricsConfigError)
    values, sources = {}, {}
    for field, flag in METRICS_FLAGS.items():
        if flag[0] in environ:
            values[field], sources[field] = environ[flag[0]], flag[0]
    _validated(values, sources)  # a bad value there is refused even where an option overrides it
    for field, value in (cli or {}).items():
        if value is not None:
            values[field], sources[field] = value, METRICS_FLAGS[field][1]
    return _validated(values, sources)


def _validated(values: Mapping[str, object], sources: Mapping[str, str]) -> MetricsConfig:
    """``MetricsConfig(**values)``, or MetricsConfigError naming the first bad value's source."""
    try:
        return MetricsConfig(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0])
        source = sources.get(field, METRICS_FLAGS[field][0])
        reason = error["msg"].removeprefix("Value error, ")
        raise MetricsConfigError(
            f"{source}={values.get(field)!r} is invalid ({reason}); allowed:"
            f" {METRICS_FLAGS[field][3]}"
        ) from None


def add_metrics_args(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port``, ``--metrics-host`` and ``--metrics-file`` (default None: the
    environment, then the built-in default, decides)."""
    for field, (env, option, metavar, _, meaning) in METRICS_FLAGS.items():
        parser.add_argument(
            option,
            dest=f"metrics_{field}",
            metavar=metavar,
            default=None,
            help=f"{meaning} (default: ${env}, else {'127.0.0.1' if field == 'host' else 'none'})",
        )


def metrics_config_from_args(environ: Mapping[str, str], args: argparse.Namespace) -> MetricsConfig:
    """The metrics settings of a command: its options over the environment. Pure."""
    return metrics_config(
        environ, {field: getattr(args, f"metrics_{field}") for field in METRICS_FLAGS}
    )
