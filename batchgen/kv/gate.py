"""``BATCHGEN_WORKER_KV_*``: the KV slice's gate (``compare.gates``), and the path it picks.

Variables (``GATE_FLAGS``; the README's flags table says what each means)::

    BATCHGEN_WORKER_KV_PATH            plan, legacy      default plan
    BATCHGEN_WORKER_KV_COMPARE         off, log, raise   default off
    BATCHGEN_WORKER_KV_COMPARE_SAMPLE  float in (0, 1]   default 1.0
    BATCHGEN_WORKER_KV_COMPARE_LOG     path              default kv-divergences.jsonl
    BATCHGEN_WORKER_KV_COMPARE_OPS     comma list        default: all five ops
    BATCHGEN_WORKER_KV_COMPARE_BUDGET          fraction in (0, 1) or off   default off
    BATCHGEN_WORKER_KV_COMPARE_BREAKER_ERRORS  int >= 1 or off             default 10 (*)
    BATCHGEN_WORKER_KV_COMPARE_BREAKER_SECONDS float > 0 or off            default 1.0 (*)
    BATCHGEN_WORKER_KV_LOAD_FAILURE    recompute, fail   default: the engine config's
    BATCHGEN_WORKER_KV_PREFIX_CACHE    on, off           default: the cache config's (**)
    BATCHGEN_WORKER_KV_VERIFY          off, sample, all  default off (page-content oracle)
    BATCHGEN_WORKER_KV_COMPARE_DEMO_BUG        a demo bug's name, or off   default off

The demo bug (``batchgen.kv.known_bugs``) is planted in the shadow path only, on its fork: the
authoritative path and the job's output stay right, and compare mode logs the divergence.

(*) ``gate_config``'s defaults (``compare.gates.BREAKER_DEFAULTS``), a production worker's: a
``KvGateConfig`` built in code (validate, sweep, explore, minimize) has no breaker unless it
names one. (**) Prefix caching: on for ``generate`` and ``batchgen.LLM`` (their pools'
``entrypoints.pool_sizes``), the workload's for ``run``, ``sweep`` and ``explore``; its options are
vLLM's, ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``. Parsing, precedence and
messages are ``compare.gates``'. The legacy path module is imported only when a path named
"legacy" is built (``kv_path_class``).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from batchgen.config import KV_GATE_PREFIX, WORKER_GATE_PREFIXES, CacheConfig, EngineConfig
from batchgen.kv.known_bugs import DEMO_BUGS
from compare.gates import CompareGate, GateError, GateFamily, off_is_none

ENV_PREFIX = KV_GATE_PREFIX
KV_BINDING = "kv"  # the binding compare mode's records name (compare.records)
KV_OPS = ("poll", "release", "evict", "migrate", "alloc")


class KvGateConfig(CompareGate):
    PATHS: ClassVar[tuple[str, str]] = ("plan", "legacy")
    OPS: ClassVar[tuple[str, ...]] = KV_OPS

    path: Literal["plan", "legacy"] = "plan"
    compare_log: str = Field(default="kv-divergences.jsonl", min_length=1)
    compare_ops: tuple[str, ...] = KV_OPS
    # None: keep the engine config's policy (the edge applies it: ``engine_config``)
    load_failure: Literal["recompute", "fail"] | None = None
    # None: keep the cache config's prefix caching (the edge applies it: ``cache_config``)
    prefix_cache: Literal["on", "off"] | None = None
    # page-content oracle (batchgen.engine.kv_verify): every step, the compare-sampled ones, or none
    verify: Literal["off", "sample", "all"] = "off"
    # a known bug planted in the shadow path (batchgen.kv.known_bugs); None: none
    compare_demo_bug: Literal[DEMO_BUGS] | None = None

    @field_validator("compare_demo_bug", mode="before")
    @classmethod
    def _no_demo_bug(cls, value):
        return off_is_none(value)

    def engine_config(self, engine: EngineConfig | None = None) -> EngineConfig:
        """``engine`` (default: the defaults) with this gate's load failure policy, when it sets
        one: the edge's, before the worker is built. Pure."""
        engine = engine or EngineConfig()
        if self.load_failure is None:
            return engine
        return engine.model_copy(update={"load_failure": self.load_failure})

    def cache_config(self, cache: CacheConfig) -> CacheConfig:
        """``cache`` with this gate's prefix caching, when it sets it: the edge's, before the
        worker is built. Pure."""
        if self.prefix_cache is None:
            return cache
        return cache.model_copy(update={"enable_prefix_caching": self.prefix_cache == "on"})


KV_GATES = GateFamily(
    ENV_PREFIX,
    "--kv-",
    KvGateConfig,
    {
        "load_failure": "recompute, fail",
        "prefix_cache": "on, off",
        "verify": "off, sample, all",
        "compare_demo_bug": f"off, {', '.join(DEMO_BUGS)}",
    },
    options={"prefix_cache": "--enable-prefix-caching"},  # vLLM's, with its --no- form
    siblings=WORKER_GATE_PREFIXES,
)
# field name -> (environment variable, CLI option, allowed values for messages)
GATE_FLAGS = KV_GATES.flags
gate_config = KV_GATES.parse


def kv_path_class(name: str) -> type:
    """The KV path class for ``name``; legacy is imported only here."""
    if name == "plan":
        from batchgen.kv.plan_path import PlanKvPath

        return PlanKvPath
    if name == "legacy":
        from batchgen.kv.legacy import LegacyKvPath

        return LegacyKvPath
    raise GateError(f"unknown KV path {name!r}; allowed: plan, legacy")


def build_kv_path(name: str, target):
    """The KV path object for ``name`` over ``target``."""
    return kv_path_class(name)(target)
