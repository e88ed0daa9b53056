"""What every sweep backend shares: the retry loop over its primitives (submit, wait, result,
cancel), what a task ends as (``TaskDone``, ``TaskFailed``), and the errors a backend raises.
``backends`` says how ``map_runs`` behaves; ``ray_backend`` and ``process_backend`` implement the
primitives."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
