"""Ray tasks as a sweep backend: one task of 1 CPU per call, placed by Ray's scheduler on a local
instance or a cluster; and how Ray is imported and started (``generate``'s replicas start it the
same way)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from batchgen.sweep.backend_base import WORKER_DIED, AttemptFailed, BackendError, SweepBackend
from compare import exception_text

RAY_INSTALL = "pip install 'batchgen[ray]'"


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
