"""What the harness raises and warns: a divergence in "raise" mode, a failure of its own."""

from __future__ import annotations

import warnings

from compare.observation import Comparison, exception_text

UNCLASSIFIED = "unclassified"  # the kind recorded when the classifier itself fails
_MAX_MESSAGE_PATHS = 10


class DivergenceError(AssertionError):
    """Raised in "raise" mode when the shadow path diverges from the authoritative one."""

    def __init__(self, comparison: Comparison) -> None:
        super().__init__(describe(comparison))
        self.comparison = comparison


class HarnessWarning(RuntimeWarning):
    """Emitted by the default `on_harness_error`: the harness failed, the caller did not."""


def warn_harness_error(operation: str, error: BaseException) -> None:
    """Default `on_harness_error`: warn and carry on (the executor counts every call)."""
    message = f"compare harness failed in {operation}: {exception_text(error)}"
    warnings.warn(message, HarnessWarning, stacklevel=3)


def describe(comparison: Comparison) -> str:
    """The op, step, kind and paths of a divergence, and the exceptions either side raised. Pure."""
    authoritative, shadow = comparison.authoritative, comparison.shadow
    lines = [
        f"{comparison.op} step {comparison.step}: {comparison.kind} divergence, "
        f"shadow {shadow.path!r} vs authoritative {authoritative.path!r}"
    ]
    paths = comparison.field_paths
    if paths:
        more = len(paths) - _MAX_MESSAGE_PATHS
        shown = ", ".join(paths[:_MAX_MESSAGE_PATHS])
        lines.append(f"paths: {shown}" + (f" (+{more} more)" if more > 0 else ""))
    lines += comparison.exceptions
    return "\n".join(lines)
