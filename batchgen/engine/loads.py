"""What became of the loads in flight: the input of the poll op, read by the worker each step."""

from __future__ import annotations

from batchgen.state import Phase, WorkerState

LOAD_TIMEOUT = "LoadTimeout"  # how the error of a load that never completed begins


def observe_loads(state: WorkerState, timeout_steps: int) -> dict[str, str | None]:
    """Outcomes of the LOADING requests' loads: uuid -> None (done) or the error text; loads still
    pending are left out. A copy issued last step is waited for: it overlapped that step's
    forward. A handle that says it may stall (``may_stall``, e.g. fault injection) is read only
    when done; one incomplete after ``timeout_steps`` steps counts as failed. Pure, but for
    waiting on the copies."""
    observed = {}
    for req in state.in_phase(Phase.LOADING):
        handle = req.load_handle
        if getattr(handle, "may_stall", False) and not handle.done():
            age = state.step - req.load_started_step
            if age >= timeout_steps:
                observed[req.uuid] = f"{LOAD_TIMEOUT}: no completion after {age} steps"
            continue
        try:
            handle.wait()
            observed[req.uuid] = None
        except Exception as exc:  # a failed copy is an input to poll, not a crash
            observed[req.uuid] = f"{type(exc).__name__}: {exc}"
    return observed
