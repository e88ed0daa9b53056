"""Sweep tasks for the tests: ``run_cell`` behind seams that end an attempt early or inject a bug.

Module-level functions, so that a worker process (spawned by the process backend, or Ray's, with
this directory on its PYTHONPATH) imports them by name. Each attempt at a marked run leaves a
file in ``marker_dir``: the tests count attempts from the file system, the one thing the driver,
its workers and this process share here.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from injected_bugs import reversed_grants

from batchgen.engine.worker import Worker
from batchgen.sweep.matrix import SweepCell, run_cell

KILLED_AT_STEP = 5  # a killed attempt runs this many worker steps first: it dies mid-run


def failing_run(
    cell: SweepCell, *, marker_dir: str, run_ids: tuple[str, ...], num_failures: int, how: str
) -> tuple[str, ...]:
    """``run_cell(cell)``, but the first ``num_failures`` attempts at a run of ``run_ids`` fail:
    ``how="kill"``: SIGKILL ends the worker process mid-run (at worker step ``KILLED_AT_STEP``);
    ``how="raise"``: RuntimeError before the run starts (a task that crashes while setting up)."""
    if cell.run_id not in run_ids:
        return run_cell(cell)
    attempt = num_attempts(marker_dir, cell.run_id)
    (Path(marker_dir) / f"{cell.run_id}.{attempt}").touch()
    if attempt >= num_failures:
        return run_cell(cell)
    if how == "raise":
        raise RuntimeError(f"injected crash of attempt {attempt + 1}")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(Worker, "step", _dying_step(Worker.step))
        return run_cell(cell)


def _dying_step(step):
    """``Worker.step`` that kills its own process (SIGKILL) once the worker reaches
    ``KILLED_AT_STEP``."""

    def dying_step(worker: Worker) -> None:
        if worker.state.step == KILLED_AT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        step(worker)

    return dying_step


def num_attempts(marker_dir: str, run_id: str) -> int:
    """How many attempts ``failing_run`` saw at the run ``run_id``."""
    return len(list(Path(marker_dir).glob(f"{run_id}.*")))


def run_with_reversed_grants(cell: SweepCell) -> tuple[str, ...]:
    """``run_cell(cell)`` with the plan path handing out each grant's pages in reverse: alloc
    divergences (``injected_bugs.reversed_grants``), in whichever process runs it."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        reversed_grants(monkeypatch)
        return run_cell(cell)
