"""``BATCHGEN_WORKER_FINISH_*``: the finish slice's gate, built on ``compare.gates`` as it gives
every slice (no field of its own)::

    BATCHGEN_WORKER_FINISH_PATH                     plan, legacy    default plan
    BATCHGEN_WORKER_FINISH_COMPARE                  off, log, raise default off
    BATCHGEN_WORKER_FINISH_COMPARE_SAMPLE           float in (0, 1] default 1.0
    BATCHGEN_WORKER_FINISH_COMPARE_LOG              path            finish-divergences.jsonl
    BATCHGEN_WORKER_FINISH_COMPARE_OPS              finish          default finish
    BATCHGEN_WORKER_FINISH_COMPARE_BUDGET           fraction in (0, 1) or off
    BATCHGEN_WORKER_FINISH_COMPARE_BREAKER_ERRORS   int >= 1 or off
    BATCHGEN_WORKER_FINISH_COMPARE_BREAKER_SECONDS  float > 0 or off

each with its option ``--finish-path``, ``--finish-compare``, ... Parsing, precedence, the
breaker's defaults and the messages (a typo in the family names the closest valid variable) are
``compare.gates``'.
"""

from typing import ClassVar, Literal

from pydantic import Field

from batchgen.config import FINISH_GATE_PREFIX as PREFIX
from batchgen.config import WORKER_GATE_PREFIXES as SIBLINGS
from compare.gates import CompareGate, GateFamily

FINISH_OP = "finish"  # the slice's one op, and the binding its records name


class FinishGateConfig(CompareGate):
    PATHS: ClassVar[tuple[str, str]] = ("plan", "legacy")
    OPS: ClassVar[tuple[str, ...]] = (FINISH_OP,)

    path: Literal["plan", "legacy"] = "plan"
    compare_log: str = Field(default="finish-divergences.jsonl", min_length=1)
    compare_ops: tuple[str, ...] = (FINISH_OP,)


FINISH_GATES = GateFamily(PREFIX, "--finish-", FinishGateConfig, {}, siblings=SIBLINGS)
