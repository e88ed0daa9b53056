"""Compare mode's binding to the KV ops: the fork, canonical forms, decision coverage, the HTML
report's KV panels and the pytest plugin. Validation lives in ``batchgen.validation``; replay and
minimize in ``batchgen.triage``; sweeps in ``batchgen.sweep``."""
