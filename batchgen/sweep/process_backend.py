"""Local worker processes as a sweep backend: one single-process pool per worker, so a pool that
breaks names the task it ran; and those pools (``generate``'s process replicas use them too)."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from batchgen.sweep.backend_base import WORKER_DIED, AttemptFailed, SweepBackend
from compare import exception_text


class ProcessBackend(SweepBackend):
    """``num_workers`` worker processes on this machine, each a ``ProcessPoolExecutor`` of one
    process running one task at a time: a process that dies breaks its own pool only, which names
    the task it was running (a shared pool fails every task in flight). Workers are started as
    tasks need them, reused, and replaced when they die, each forked from a server process
    (``forkserver``: a fresh interpreter, not this one, so no torch state of the driver's) that
    imported ``WORKER_PRELOAD`` once: a new worker starts in milliseconds, not the seconds an
    import of torch takes."""

    def __init__(self, num_workers: int):
        self.capacity = self.num_workers = num_workers
        self._pools: dict[futures.Future, futures.ProcessPoolExecutor] = {}
        self._idle: list[futures.ProcessPoolExecutor] = []

    def close(self) -> None:
        for pool in self._idle:
            pool.shutdown()
        self._idle.clear()

    def _submit(self, function: Callable, argument) -> Any:
        pool = self._idle.pop() if self._idle else new_pool()
        future = pool.submit(function, argument)
        self._pools[future] = pool
        return future

    def _wait(self, handles: list, timeout_s: float) -> list:
        done, _ = futures.wait(handles, timeout_s, return_when=futures.FIRST_COMPLETED)
        return list(done)

    def _result(self, handle: futures.Future) -> Any:
        pool = self._pools.pop(handle)
        try:
            value = handle.result()
        except BrokenProcessPool:
            pool.shutdown(wait=False)
            raise AttemptFailed(WORKER_DIED) from None
        except Exception as error:
            self._idle.append(pool)
            raise AttemptFailed(exception_text(error).splitlines()[0]) from None
        self._idle.append(pool)
        return value

    def _cancel(self, handles: list) -> None:
        for handle in handles:
            kill_pool(self._pools.pop(handle))


# What every task of a sweep or a search imports: the worker, its model and torch.
WORKER_PRELOAD = ("batchgen.engine.runner",)


def new_pool(preload: tuple[str, ...] = WORKER_PRELOAD) -> futures.ProcessPoolExecutor:
    """A pool of one worker process, forked from the server that imported ``preload`` (read when
    the server first starts: one server per process, its first pool's preload)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    return futures.ProcessPoolExecutor(
        max_workers=1, mp_context=context, initializer=_ignore_interrupts
    )


def _ignore_interrupts() -> None:
    """A worker ignores Ctrl-C, which a terminal sends its whole process group: the driver decides
    what stops (it cancels the tasks in flight, and writes what finished)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def kill_pool(pool: futures.ProcessPoolExecutor) -> None:
    """Stop the pool's process at once, mid-task. Mutates the pool."""
    # ProcessPoolExecutor has no public way to stop a running call before Python 3.14
    for process in list((pool._processes or {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)
