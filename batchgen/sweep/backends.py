"""Where a sweep's tasks run: Ray tasks (a local instance or a cluster), or local processes.

::

    with RayBackend(address=..., num_cpus=...) as backend:      # or ProcessBackend(num_workers)
        backend.map_runs(function, arguments, on_done, max_retries=3, deadline=None)

``map_runs`` calls ``function(argument)`` for each argument as a task (any
picklable function and arguments: ``run_cell`` and its cells, or another command's
candidate workloads) and, in the driver, ``on_done(index, outcome)`` as each one
ends, in completion order: ``TaskDone(value, num_attempts)``, or
``TaskFailed(error, num_attempts)`` for a task that failed in each of its
``1 + max_retries`` attempts. A failed attempt is an exception the function
raised, a worker process that died (killed, out of memory, crashed), or a node
lost; it is retried before the tasks still queued. At ``deadline`` (a
``time.monotonic()`` value) no task starts and those in flight are cancelled; Ctrl-C
(or SIGTERM, a KeyboardInterrupt under the entry point) cancels them too, and
propagates.

    RayBackend      one Ray task per call (1 CPU each), Ray's scheduler places them on the cluster
    ProcessBackend  one single-process pool per worker: a pool that breaks names the task it ran
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from compare import exception_text

RAY_INSTALL = "pip install 'batchgen[ray]'"
_POLL_S = 0.5  # longest wait for a task to end before the loop looks at its deadline again
WORKER_DIED = "its worker process died (killed, out of memory, or crashed)"


class BackendError(ValueError):
    """A backend that cannot start: Ray not installed, or no cluster at the address given."""


class AttemptFailed(Exception):
    """One attempt of a task failed; the message says how."""


@dataclass(frozen=True, slots=True)
class TaskDone:
    value: Any  # what the function returned
    num_attempts: int  # 1, or more when earlier attempts failed


@dataclass(frozen=True, slots=True)
class TaskFailed:
    error: str  # how the last attempt failed
    num_attempts: int


OnDone = Callable[[int, TaskDone | TaskFailed], None]


class SweepBackend(ABC):
    """The retry loop over a backend's primitives: submit, wait, result, cancel (and close)."""

    num_workers: int  # tasks running at once (CPUs of the Ray cluster, worker processes)
    capacity: int  # tasks in flight at once (running or queued in the backend)

    def map_runs(
        self,
        function: Callable,
        arguments: Sequence,
        on_done: OnDone,
        *,
        max_retries: int = 0,
        deadline: float | None = None,
    ) -> None:
        """Run ``function(argument)`` for each argument as a task (see the module docstring);
        returns when every task ended, or at ``deadline``. Mutates the backend's workers."""
        queue = deque(range(len(arguments)))
        num_attempts = [0] * len(arguments)
        in_flight: dict[Any, int] = {}
        try:
            while (queue or in_flight) and not _is_past(deadline):
                while queue and len(in_flight) < self.capacity:
                    index = queue.popleft()
                    num_attempts[index] += 1
                    in_flight[self._submit(function, arguments[index])] = index
                for handle in self._wait(list(in_flight), _wait_s(deadline)):
                    index = in_flight.pop(handle)
                    try:
                        outcome = TaskDone(self._result(handle), num_attempts[index])
                    except AttemptFailed as failure:
                        if num_attempts[index] <= max_retries:
                            queue.appendleft(index)
                            continue
                        outcome = TaskFailed(str(failure), num_attempts[index])
                    on_done(index, outcome)
        finally:
            if in_flight:
                self._cancel(list(in_flight))

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @abstractmethod
    def close(self) -> None:
        """Stop what the backend started (workers, a local Ray instance)."""

    @abstractmethod
    def _submit(self, function: Callable, argument) -> Any:
        """Start ``function(argument)`` as a task; its handle."""

    @abstractmethod
    def _wait(self, handles: list, timeout_s: float) -> list:
        """The handles of tasks that ended (none when ``timeout_s`` passed first)."""

    @abstractmethod
    def _result(self, handle) -> Any:
        """The task's value; AttemptFailed saying how it failed."""

    @abstractmethod
    def _cancel(self, handles: list) -> None:
        """Stop the tasks of ``handles`` (queued or running)."""


def _is_past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _wait_s(deadline: float | None) -> float:
    if deadline is None:
        return _POLL_S
    return max(0.0, min(_POLL_S, deadline - time.monotonic()))


# ---- Ray -----------------------------------------------------------------------------------------
class RayBackend(SweepBackend):
    """Ray tasks of 1 CPU each, on the cluster at ``address`` (``auto``: the one this machine is
    part of) or on a local instance of ``num_cpus`` CPUs (default: all) started here and shut down
    by ``close``. An instance already started in this process (``ray.init``) is used as it is.
    Retries are this loop's, not Ray's (``max_retries=0``), so that each one is counted."""

    def __init__(self, *, address: str | None = None, num_cpus: int | None = None):
        ray = import_ray()
        self._ray = ray
        self._owns_instance = start_ray(address, num_cpus)
        self.num_workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        # queued tasks keep every CPU busy while the driver handles the results of others
        self.capacity = 2 * self.num_workers
        self._task = ray.remote(num_cpus=1, max_retries=0, retry_exceptions=False)(_call)

    def close(self) -> None:
        if self._owns_instance:
            self._ray.shutdown()

    def _submit(self, function: Callable, argument) -> Any:
        return self._task.remote(function, argument)

    def _wait(self, handles: list, timeout_s: float) -> list:
        first, _ = self._ray.wait(handles, num_returns=1, timeout=timeout_s)
        if not first:
            return []
        done, _ = self._ray.wait(handles, num_returns=len(handles), timeout=0)  # all ended by now
        return done

    def _result(self, handle) -> Any:
        exceptions = self._ray.exceptions
        try:
            return self._ray.get(handle)
        except exceptions.RayTaskError as error:  # the function raised
            raise AttemptFailed(exception_text(error.cause or error).splitlines()[0]) from None
        except exceptions.WorkerCrashedError:
            raise AttemptFailed(WORKER_DIED) from None
        except exceptions.RayError as error:  # a node lost, an object lost, out of memory, ...
            raise AttemptFailed(exception_text(error).splitlines()[0]) from None

    def _cancel(self, handles: list) -> None:
        for handle in handles:
            with contextlib.suppress(Exception):  # a task that ended meanwhile
                self._ray.cancel(handle, force=True)


def import_ray():
    """The ``ray`` module; BackendError saying how to install it when it is not. Imports Ray."""
    try:
        import ray
    except ImportError:
        raise BackendError(
            f"--backend ray needs Ray, which is not installed: {RAY_INSTALL} (or use "
            "--backend processes)"
        ) from None
    return ray


def start_ray(address: str | None, num_cpus: int | None) -> bool:
    """Join the cluster at ``address``, or start a local instance of ``num_cpus`` CPUs (default:
    all), unless this process has Ray started already (used as it is). Returns whether it started
    one, which its caller then shuts down. BackendError when Ray cannot start there. Keeps this
    process's SIGTERM handler."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(
            address=address or "local",
            num_cpus=num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            # task output would tear the progress bar; failures come back as exceptions
            log_to_driver=False,
        )
    except Exception as error:
        where = f"the cluster at {address}" if address else "a local instance"
        raise BackendError(
            f"--backend ray: cannot start on {where}: {' '.join(str(error).split())}"
        ) from None
    finally:
        # ray.init installs a SIGTERM handler that exits with status 15 (and a C++ one that logs
        # a stack): the command's own (Terminated: the same cleanup as Ctrl-C, exit 143) is back
        if on_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)
    return True


def _call(function: Callable, argument) -> Any:
    """The Ray task: ``function(argument)``."""
    return function(argument)


# ---- local processes -----------------------------------------------------------------------------
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
        pool = self._idle.pop() if self._idle else _new_pool()
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
            _kill(self._pools.pop(handle))


# What every task of a sweep or a search imports: the worker, its model and torch.
WORKER_PRELOAD = ("batchgen.engine.runner",)


def _new_pool(preload: tuple[str, ...] = WORKER_PRELOAD) -> futures.ProcessPoolExecutor:
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


def _kill(pool: futures.ProcessPoolExecutor) -> None:
    """Stop the pool's process at once, mid-task. Mutates the pool."""
    # ProcessPoolExecutor has no public way to stop a running call before Python 3.14
    for process in list((pool._processes or {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)
