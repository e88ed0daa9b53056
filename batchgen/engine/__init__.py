"""The engine: the worker and its step, request state, scheduling, sampling, faults, workloads and
the runner."""
