"""Which steps a run compares: a seeded, reproducible fraction of them."""

from __future__ import annotations

import hashlib


def is_sampled_step(seed: int, step: int, sample: float) -> bool:
    """Whether ``step`` is among the fraction ``sample`` of steps a run seeded ``seed`` compares:
    a hash of (seed, step) below ``sample``. Pure."""
    if sample >= 1.0:
        return True
    digest = hashlib.blake2b(f"{seed}\0{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < sample
