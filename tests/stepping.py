"""Driving a worker in a test, bounded: a bug that keeps a request alive fails the test with the
step count instead of hanging it."""

from __future__ import annotations

from batchgen.engine.worker import Worker


def step_to_end(worker: Worker, max_steps: int, *, check_integrity: bool = False) -> int:
    """Step ``worker`` until nothing is unfinished (checking its pools after each step when
    ``check_integrity``); returns the steps taken. AssertionError when ``max_steps`` did not
    finish it. Mutates the worker."""
    for num_steps in range(max_steps):
        if not worker.has_unfinished():
            return num_steps
        worker.step()
        if check_integrity:
            worker.check_integrity()
    if worker.has_unfinished():
        raise AssertionError(f"{len(worker.state.requests)} requests unfinished after {max_steps}")
    return max_steps
