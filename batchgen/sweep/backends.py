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

The loop and the outcomes live in ``backend_base``, each backend in a module of its own
(``ray_backend``, ``process_backend``); this module names them together.
"""

from batchgen.sweep.backend_base import (
    WORKER_DIED,
    AttemptFailed,
    BackendError,
    OnDone,
    SweepBackend,
    TaskDone,
    TaskFailed,
)
from batchgen.sweep.process_backend import WORKER_PRELOAD, ProcessBackend
from batchgen.sweep.ray_backend import RAY_INSTALL, RayBackend, import_ray, start_ray

__all__ = [
    "RAY_INSTALL",
    "WORKER_DIED",
    "WORKER_PRELOAD",
    "AttemptFailed",
    "BackendError",
    "OnDone",
    "ProcessBackend",
    "RayBackend",
    "SweepBackend",
    "TaskDone",
    "TaskFailed",
    "import_ray",
    "start_ray",
]
