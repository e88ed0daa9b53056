"""The A/B timer every benchmark shares: variants run interleaved in one process, calls timed by
wrapping them, and ratios taken per repeat.

    in_turn / interleaved   the order of the variants in each repeat: rotated by one (each variant
                            takes every position), or reversed every other repeat
    time_kv_ops             the worker's five KV ops (the methods of its path object,
                            ``worker._kv``) wrapped so that each call's time reaches a sink
    timed_call              the same for any one callable (a worker method, a module function)
    timed_run               one whole run's wall and process CPU seconds
    median_ratio            the median of the per-repeat ratios, and the ratios

Clocks read nanoseconds: ``cpu`` is the calling thread's CPU time (less disturbed by other
processes; a read is a system call, whose cost ``clock_overhead_ns`` measures so that a timed call
can subtract it), ``wall`` the performance counter, ``process`` the process's CPU time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from batchgen.kv.gate import KV_OPS
from batchgen.kv.plan_path import OP_METHODS

T = TypeVar("T")
Clock = Callable[[], int]
Sink = Callable[[str, int], None]  # (name of the timed call, nanoseconds it took)
CLOCKS: dict[str, Clock] = {
    "cpu": time.thread_time_ns,
    "wall": time.perf_counter_ns,
    "process": time.process_time_ns,
}


def clock_overhead_ns(clock: Clock) -> int:
    """What one timed interval adds by itself: the smallest of five medians of 2000 reads."""
    return min(statistics.median(-clock() + clock() for _ in range(2000)) for _ in range(5))


def adding_to(totals: dict) -> Sink:
    """A sink that adds each call's nanoseconds to ``totals[name]`` (mutates ``totals``)."""

    def add(name: str, ns: int) -> None:
        totals[name] += ns

    return add


def timed_call(
    name: str, call: Callable, sink: Sink, clock: Clock = CLOCKS["cpu"], overhead_ns: int = 0
) -> Callable:
    """``call`` wrapped: each call's time on ``clock``, less ``overhead_ns`` (never below 0), goes
    to ``sink(name, ns)``, also when the call raises. Pure (the wrapper mutates via ``sink``)."""

    def timed(*args, **kwargs):
        started = clock()
        try:
            return call(*args, **kwargs)
        finally:
            sink(name, max(0, clock() - started - overhead_ns))

    return timed


def wrap_kv_ops(worker, wrapper: Callable[[str, Callable], Callable]) -> None:
    """Mutates ``worker._kv`` (its KV path object; its class is untouched): each op's method
    becomes the instance attribute ``wrapper(op, method)``, ops named as in ``KV_OPS``."""
    kv = worker._kv
    for op in KV_OPS:
        method = OP_METHODS[op][0]
        setattr(kv, method, wrapper(op, getattr(kv, method)))


def time_kv_ops(worker, sink: Sink, clock: Clock = CLOCKS["cpu"], overhead_ns: int = 0) -> None:
    """Mutates ``worker._kv``: every KV op call's time (``timed_call``) goes to ``sink``."""
    wrap_kv_ops(worker, lambda op, call: timed_call(op, call, sink, clock, overhead_ns))


def in_turn(variants: Sequence[T], repeat: int, *, rotate: bool = True) -> list[T]:
    """The order of ``variants`` in repeat ``repeat`` (from 0): rotated left by ``repeat``, or,
    with ``rotate`` False, as given in even repeats and reversed in odd ones. Pure."""
    if not rotate:
        return list(variants if repeat % 2 == 0 else variants[::-1])
    shift = repeat % len(variants)
    return [*variants[shift:], *variants[:shift]]


def interleaved(
    variants: Sequence[T], repeats: int, run: Callable[[T], Any], *, rotate: bool = True
) -> dict[T, list]:
    """``run(variant)`` for every variant ``repeats`` times, in the order of ``in_turn``; each
    variant's results in repeat order."""
    results: dict[T, list] = {variant: [] for variant in variants}
    for repeat in range(repeats):
        for variant in in_turn(variants, repeat, rotate=rotate):
            results[variant].append(run(variant))
    return results


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> tuple:
    """(the median of the per-repeat ratios, the ratios); ValueError when the counts differ.
    Pure."""
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True)]
    return statistics.median(ratios), ratios


@dataclass(frozen=True, slots=True)
class Timed:
    """What a timed run returned, with its wall and process CPU seconds."""

    result: Any
    wall_s: float
    cpu_s: float


def timed_run(call: Callable[[], Any], *, cuda: bool = False) -> Timed:
    """``call()`` timed; with ``cuda`` the device is synchronized before and after."""
    if cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    result = call()
    if cuda:
        torch.cuda.synchronize()
    return Timed(result, time.perf_counter() - wall, time.process_time() - cpu)
