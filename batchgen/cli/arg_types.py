"""The flags' value parsers (argparse ``type=``): each refuses a bad value with what is allowed."""

from __future__ import annotations

import argparse
import math

from batchgen.engine.workloads import MAX_SCALE


def non_negative_int(text: str) -> int:
    return int_at_least(text, 0)


MAX_SEED = 2**64 - 1  # torch generators take 64-bit seeds


MAX_SEEDS = 1_000_000  # seeds one --seeds list may hold (a sweep's runs are built up front)


# torch takes an int32 thread count, and spawns them all at the first parallel op
MAX_THREADS = 1024


def seed_int(text: str) -> int:
    return int_in_range(text, 0, MAX_SEED, "2**64 - 1")


def threads_int(text: str) -> int:
    return int_in_range(text, 1, MAX_THREADS, str(MAX_THREADS))


def int_in_range(text: str, minimum: int, maximum: int, maximum_shown: str) -> int:
    """``text`` as an integer in [minimum, maximum]; ``maximum_shown``: how the message writes the
    maximum."""
    value = int_at_least(text, minimum)
    if value > maximum:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [{minimum}, {maximum_shown}], got {text!r}"
        )
    return value


def positive_int(text: str) -> int:
    return int_at_least(text, 1)


def int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
    return value


def scale_float(text: str) -> float:
    """``--scale``: a number in (0, MAX_SCALE], as ``load_workload`` takes it."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_SCALE:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a number in (0, {MAX_SCALE:g}], got {text!r}")
    return value


def seed_list(text: str) -> tuple[int, ...]:
    """``--seeds``: ``N``, ``A-B`` (inclusive) or a comma list of both, each seed once, in the
    order given."""
    seeds: dict[int, None] = {}
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            low = high = -1
        if not 0 <= low <= high <= MAX_SEED:
            raise argparse.ArgumentTypeError(
                f"must be N, A-B (0 <= A <= B <= 2**64 - 1) or a comma list of them, got {text!r}"
            )
        if len(seeds) + high - low + 1 > MAX_SEEDS:
            raise argparse.ArgumentTypeError(f"holds more than {MAX_SEEDS} seeds, got {text!r}")
        seeds.update(dict.fromkeys(range(low, high + 1)))
    return tuple(seeds)


def positive_float(text: str, what: str = "a positive finite number") -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def seconds_float(text: str) -> float:
    return positive_float(text, "a number of seconds > 0")


def fraction_float(text: str) -> float:
    """``text`` as a number in (0, 1] (a share of memory)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: (0, 1]") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is outside (0, 1]")
    return value
