"""What the harness raises and warns: a divergence in "raise" mode, a failure of its own."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from compare.explain import explain, row_lines
from compare.observation import Comparison, exception_text

UNCLASSIFIED = "unclassified"  # the kind recorded when the classifier itself fails
_MAX_MESSAGE_ROWS = 10


class DivergenceError(AssertionError):
    """Raised in "raise" mode when the shadow path diverges from the authoritative one."""

    def __init__(self, comparison: Comparison) -> None:
        super().__init__(describe(comparison))
        self.comparison = comparison


class HarnessWarning(RuntimeWarning):
    """Emitted by the default `on_harness_error`: the harness failed, the caller did not."""


class HarnessFunnel:
    """The one way a failure inside the harness is reported: counted, then handed to
    ``on_harness_error``; one that raises makes harness failures fatal. Mutates only itself."""

    def __init__(self, on_harness_error: Callable[[str, BaseException], None]) -> None:
        self.count = 0
        self._on_harness_error = on_harness_error
        self._fatal: BaseException | None = None  # the last error on_harness_error raised

    def guard(self, operation: str, call: Callable[..., Any], *args: Any, default: Any) -> Any:
        """``call(*args)``; on failure, report it and return ``default``."""
        try:
            return call(*args)
        except Exception as error:
            if error is self._fatal:  # a nested guard's failure, already reported and re-raised
                raise
            self.report(operation, error)
            return default

    def report(self, operation: str, error: Exception) -> None:
        self.count += 1
        try:
            self._on_harness_error(operation, error)
        except BaseException as fatal:
            self._fatal = fatal
            raise


def warn_harness_error(operation: str, error: BaseException) -> None:
    """Default `on_harness_error`: warn and carry on (the executor counts every call)."""
    message = f"compare harness failed in {operation}: {exception_text(error)}"
    warnings.warn(message, HarnessWarning, stacklevel=3)


def describe(comparison: Comparison) -> str:
    """The op, step and kind of a divergence, a line per differing path with each side's value
    (``compare.explain``), and the exceptions either side raised. Pure."""
    authoritative, shadow = comparison.authoritative, comparison.shadow
    lines = [
        f"{comparison.op} step {comparison.step}: {comparison.kind} divergence, "
        f"shadow {shadow.path!r} vs authoritative {authoritative.path!r}"
    ]
    found = comparison.diff
    if found is not None:
        rows = explain(found.detail, found.paths, authoritative.path, shadow.path)
        lines += row_lines(rows, _MAX_MESSAGE_ROWS)
    lines += comparison.exceptions
    return "\n".join(lines)
