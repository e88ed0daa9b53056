"""Shadow execution: run an authoritative path and a shadow path of one op, compare, report.

`ShadowExecutor.run_both` returns the authoritative result, always: shadow exceptions are captured,
failures inside the harness (context capture, fork, canonicalize, diff, classifiers, divergence
hook) go through one funnel (`on_harness_error`), and an authoritative exception reaches the caller
unchanged. Only "raise" mode turns a divergence into an error (`DivergenceError`), for tests and CI.

Order of one compared step, and why:

    1. context()        pre-state / replay info, captured before anything runs
    2. fork()           isolates the shadow from the real state (harness: a failure skips the
                        comparison, and the authoritative path runs alone)
    3. shadow(fork)     on the fork, which may read the real state lazily, so it must run BEFORE
                        the authoritative path mutates anything
    4. authoritative()  on the real state; its result (or exception) is what the caller gets
    5. canonicalize     both raw observations -> their canonical forms (harness)
    6. compare          exceptions by type; values by equality, `diff` only for a mismatch; classify
    7. outcomes         when both paths returned: the decision outcomes the op reached, counted
    8. report           on_divergence(comparison, context); DivergenceError in "raise" mode

Exceptions that are not `Exception`s (KeyboardInterrupt, SystemExit, task cancellation) stop the
process, not the comparison: they propagate from either path and from the harness.

A/A noise check: pass the same path as both `authoritative` and `shadow` (on a fork); every
divergence it reports is noise (nondeterminism, ids, timings), not a bug in the other path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from functools import partial
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from compare.coverage import CoverageCounter
from compare.errors import UNCLASSIFIED, DivergenceError, HarnessFunnel, warn_harness_error
from compare.observation import (
    Comparison,
    Observation,
    ShadowStats,
    as_observed,
    compare_observations,
)
from compare.sampling import is_sampled_step

R = TypeVar("R")
F = TypeVar("F")
_FAILED = object()  # what `_guard` returns for a hook that raised, where None is a valid result


def _pair(canonicalize: Callable, authoritative: Observation, shadow: Observation) -> tuple:
    """``canonicalize``'s two forms (TypeError for anything but a pair)."""
    authoritative_form, shadow_form = canonicalize(authoritative, shadow)
    return authoritative_form, shadow_form


class ShadowExecutor:
    """Runs ops on two paths and compares them; mutates only its own counters.

    `mode`: "log" reports divergences through `on_divergence`; "raise" also raises
    `DivergenceError`. `sample` in [0, 1] and `seed` pick the compared steps (every op of a picked
    step); `ops` limits comparison to those ops (None: all). `ignore` holds path globs (see
    `compare.diff`). `classify(paths)` names a value divergence, `exception_kind(exc)` an exception
    divergence. `outcomes(op, context, authoritative, shadow)` names the decision outcomes an op
    reached (`compare.coverage`), from both paths' raw observations, once both returned.
    `on_harness_error(operation, error)` receives every failure inside the harness; one that
    raises makes harness failures fatal (useful in tests). `clock` can be faked in tests."""

    def __init__(
        self,
        *,
        mode: Literal["log", "raise"],
        sample: float = 1.0,
        seed: int = 0,
        ops: Collection[str] | None = None,
        ignore: Sequence[str] = (),
        classify: Callable[[tuple[str, ...]], str] = lambda paths: "state",
        exception_kind: Callable[[BaseException], str] = lambda error: "exception",
        outcomes: Callable[[str, Any, Observation, Observation], Iterable[str]] = (
            lambda op, context, authoritative, shadow: ()
        ),
        on_divergence: Callable[[Comparison, Any], None] = lambda comparison, context: None,
        on_harness_error: Callable[[str, BaseException], None] = warn_harness_error,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if mode not in ("log", "raise"):
            raise ValueError(f"mode must be 'log' or 'raise', not {mode!r}")
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"sample must be in [0, 1], not {sample!r}")
        if isinstance(ops, str):
            raise ValueError(
                f"ops must be a collection of op names, not the string {ops!r} (e.g. [{ops!r}])"
            )
        self._mode, self._sample, self._seed = mode, sample, seed
        self._ops = frozenset(ops) if ops is not None else None
        self._ignore = tuple(ignore)
        self._guarded_classify = partial(self._name, "classify", classify)
        self._guarded_exception_kind = partial(self._name, "exception_kind", exception_kind)
        self._outcomes = outcomes
        self._on_divergence = on_divergence
        self._harness = HarnessFunnel(on_harness_error)
        self._guard = self._harness.guard
        self._clock = clock
        self._num_compared: dict[str, int] = {}
        self._num_divergences: dict[str, int] = {}
        self._compare_seconds = 0.0
        self._authoritative_seconds = 0.0
        self._coverage = CoverageCounter()

    def should_compare(self, op: str, step: int) -> bool:
        """Whether (op, step) is compared: the ops filter, then whether the step is sampled, by a
        hash of (seed, step) below `sample` (a sampled step compares all its ops: `sample` is the
        fraction of steps compared). Deterministic and independent of call order. Pure."""
        if self._ops is not None and op not in self._ops:
            return False
        return is_sampled_step(self._seed, step, self._sample)

    def run_both(
        self,
        op: str,
        step: int,
        *,
        authoritative: Callable[[], R],
        shadow: Callable[[F], Any],
        fork: Callable[[], F] = lambda: None,
        canonicalize: Callable[[Observation, Observation], tuple[Any, Any]] = as_observed,
        context: Callable[[], Any] = lambda: None,
        shadow_path: str,
        authoritative_path: str,
    ) -> R:
        """Run one op on both paths and return the authoritative result (whatever the sampling
        says: `compare.Experiment.run` asks `should_compare` first).

        `authoritative()` returns the result; `shadow(fork())` runs the other path on what
        `fork()` returned; `canonicalize(authoritative, shadow)` maps both raw observations
        (values, or exceptions) to the forms compared, its entry for a side that raised is
        ignored. Mutates the executor's counters; whatever the callables mutate is theirs.
        """
        started = self._clock()
        timer = [0.0]  # the authoritative path's seconds, set however it ends
        try:
            captured = self._guard("context", context, default=None)
            forked = self._guard("fork", fork, default=_FAILED)
            if forked is _FAILED:  # no isolated copy to run the shadow on: nothing is compared
                return self._timed(authoritative, timer)
            shadow_seen = self._observe(shadow_path, shadow, forked)
            try:
                result = self._timed(authoritative, timer)
            except Exception as error:
                seen = Observation(authoritative_path, None, error, timer[0])
                self._settle_raised(op, step, seen, shadow_seen, captured, canonicalize)
                raise
            seen = Observation(authoritative_path, result, None, timer[0])
            comparison = self._settle(op, step, seen, shadow_seen, captured, canonicalize)
        finally:
            self._authoritative_seconds += timer[0]
            self._compare_seconds += self._clock() - started - timer[0]
        if self._mode == "raise" and comparison is not None:
            raise DivergenceError(comparison) from comparison.shadow.exception
        return result

    @property
    def sample_rate(self) -> float:
        """The fraction of steps compared from now on (`compare.governor` moves it)."""
        return self._sample

    @sample_rate.setter
    def sample_rate(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"sample rate must be in [0, 1], not {rate!r}")
        self._sample = rate

    @property
    def compare_seconds(self) -> float:
        """Harness seconds so far (the running total `stats()` reports)."""
        return self._compare_seconds

    @property
    def num_harness_errors(self) -> int:
        return self._harness.count

    def stats(self) -> ShadowStats:
        """A frozen snapshot of the counters."""
        return ShadowStats(
            num_compared=MappingProxyType(dict(self._num_compared)),
            num_divergences=MappingProxyType(dict(self._num_divergences)),
            num_harness_errors=self._harness.count,
            compare_seconds=self._compare_seconds,
            authoritative_seconds=self._authoritative_seconds,
            coverage=MappingProxyType(self._coverage.tallies()),
        )

    def _timed(self, call: Callable[[], R], timer: list[float]) -> R:
        """``call()``, its seconds stored in ``timer[0]`` however it ends. Mutates ``timer``."""
        started = self._clock()
        try:
            return call()
        finally:
            timer[0] = self._clock() - started

    def _observe(self, path: str, run: Callable[[Any], Any], argument: Any) -> Observation:
        started = self._clock()
        try:
            value = run(argument)
        except Exception as error:
            return Observation(path, None, error, self._clock() - started)
        return Observation(path, value, None, self._clock() - started)

    def _settle_raised(self, op, step, seen, shadow_seen, captured, canonicalize) -> None:
        """``_settle`` for an authoritative path that raised: its exception is what the caller
        gets, unchanged (a fatal on_harness_error is counted, not raised instead; a hook that
        raised the exception again added frames and context to it: undone)."""
        error = seen.exception
        traceback, context = error.__traceback__, error.__context__
        try:
            self._settle(op, step, seen, shadow_seen, captured, canonicalize)
        except Exception:
            pass
        error.__traceback__, error.__context__ = traceback, context

    def _settle(
        self,
        op: str,
        step: int,
        authoritative: Observation,
        shadow: Observation,
        context: Any,
        canonicalize: Callable[[Observation, Observation], tuple[Any, Any]],
    ) -> Comparison | None:
        """Canonicalize, compare, count, and report a divergence. Returns the comparison of a
        divergence; None when the paths matched or the harness failed (the op then counts as a
        harness error, not as compared). Equal canonical forms of two paths that returned are a
        match with nothing to explain: only a mismatch builds a comparison and runs `diff`."""
        forms = self._guard(
            "canonicalize", _pair, canonicalize, authoritative, shadow, default=_FAILED
        )
        if forms is _FAILED:
            return None
        both_returned = not authoritative.raised and not shadow.raised
        if both_returned:
            equal = self._guard("compare", lambda: bool(forms[0] == forms[1]), default=_FAILED)
            if equal is _FAILED:
                return None
            if equal:
                self._count_compared(op, step, context, authoritative, shadow)
                return None
        seen = authoritative.with_value(forms[0]), shadow.with_value(forms[1])
        comparison = self._guard("compare", self._compare, op, step, *seen, default=None)
        if comparison is None:
            return None
        self._count_compared(op, step, context if both_returned else _FAILED, authoritative, shadow)
        if comparison.matched:  # equal leaves of unequal forms (NaN, ignored paths)
            return None
        self._num_divergences[op] = self._num_divergences.get(op, 0) + 1
        self._guard("on_divergence", self._on_divergence, comparison, context, default=None)
        return comparison

    def _count_compared(
        self, op: str, step: int, context: Any, authoritative: Observation, shadow: Observation
    ) -> None:
        """Count a compared op, and the outcomes it reached when both paths returned (``context``
        is ``_FAILED`` when one raised). Mutates the counters."""
        self._num_compared[op] = self._num_compared.get(op, 0) + 1
        if context is not _FAILED:
            reached = self._guard(
                "outcomes", self._outcomes, op, context, authoritative, shadow, default=()
            )
            self._coverage.add(reached, step)

    def _compare(
        self, op: str, step: int, authoritative: Observation, shadow: Observation
    ) -> Comparison:
        """`compare_observations`, its namers guarded (a failing one leaves the divergence
        unclassified)."""
        return compare_observations(
            op,
            step,
            authoritative,
            shadow,
            ignore=self._ignore,
            classify=self._guarded_classify,
            exception_kind=self._guarded_exception_kind,
        )

    def _name(self, operation: str, namer: Callable[[Any], str], argument: Any) -> str:
        """Call a classifier; if it fails, report that and keep the divergence as unclassified."""
        kind = self._guard(operation, namer, argument, default=None)
        return kind if kind is not None else UNCLASSIFIED
