"""The finish slice: what a step does with the token each served request sampled (append it, then
decide whether the request ends and why).

    plans.py      what the planner reads (``FinishRequest``: frozen, per request) and returns
                  (``FinishPlan``: per request the token to append and the finish reason or None)
    planner.py    ``plan_finish``: the stateless planner, a ``# decision:`` id on every branch
    applier.py    ``apply_finish``: a plan written into the worker's state (the plan path's writer)
    plan_path.py  ``PlanFinish``: snapshot -> plan -> apply, the default path
    legacy.py     ``LegacyFinish``: the code as it was in the worker, mutating requests in place:
                  the oracle compare mode shadows the planner with (imported only when named)
    ops.py        the seam: ``FinishOps``, ``FinishSetup``, ``FinishFactory``; paths by name
    gate.py       ``BATCHGEN_WORKER_FINISH_*`` (``compare.gates``)
    shadow.py     compare mode: the binding to ``compare.Experiment``

Releasing a finished request's pages is the KV slice's ``release`` op, the next step.
"""
