"""``BATCHGEN_WORKER_KV_*``: parsed once into a validated config, and the path it picks.

Variables (``GATE_FLAGS``; the README's flags table says what each means)::

    BATCHGEN_WORKER_KV_PATH            plan, legacy      default plan
    BATCHGEN_WORKER_KV_COMPARE         off, log, raise   default off
    BATCHGEN_WORKER_KV_COMPARE_SAMPLE  float in (0, 1]   default 1.0
    BATCHGEN_WORKER_KV_COMPARE_LOG     path              default kv-divergences.jsonl
    BATCHGEN_WORKER_KV_COMPARE_OPS     comma list        default: all five ops
    BATCHGEN_WORKER_KV_LOAD_FAILURE    recompute, fail   default: the engine config's
    BATCHGEN_WORKER_KV_VERIFY          off, sample, all  default off (page-content oracle)
    BATCHGEN_WORKER_KV_COMPARE_BUDGET          fraction in (0, 1) or off   default off
    BATCHGEN_WORKER_KV_COMPARE_BREAKER_ERRORS  int >= 1 or off             default 10 (*)
    BATCHGEN_WORKER_KV_COMPARE_BREAKER_SECONDS float > 0 or off            default 1.0 (*)
    BATCHGEN_WORKER_KV_COMPARE_DEMO_BUG        a demo bug's name, or off   default off

The demo bug (``batchgen.kv.known_bugs``) is planted in the shadow path only, on its fork: the
authoritative path and the job's output stay right, and compare mode logs the divergence.

(*) ``gate_config``'s defaults (``BREAKER_DEFAULTS``), a production worker's: a
``KvGateConfig`` built in code (validate, sweep, explore, minimize) has no breaker unless it
names one, since a validation that stops comparing must not pass.

Precedence: default < environment < CLI option. An unknown name in the family
(a typo) or a bad value (in the environment even where an option overrides it)
raises :class:`GateError` naming the variable, the allowed values and the closest
valid name. The legacy path module is imported
only when a path named "legacy" is built (``kv_path_class``).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from batchgen.kv.known_bugs import DEMO_BUGS

ENV_PREFIX = "BATCHGEN_WORKER_KV_"
KV_OPS = ("poll", "release", "evict", "migrate", "alloc")

# field name -> (environment variable, CLI option, allowed values for messages)
GATE_FLAGS = {
    "path": ("BATCHGEN_WORKER_KV_PATH", "--kv-path", "plan, legacy"),
    "compare": ("BATCHGEN_WORKER_KV_COMPARE", "--kv-compare", "off, log, raise"),
    "compare_sample": (
        "BATCHGEN_WORKER_KV_COMPARE_SAMPLE",
        "--kv-compare-sample",
        "a float in (0, 1]",
    ),
    "compare_log": ("BATCHGEN_WORKER_KV_COMPARE_LOG", "--kv-compare-log", "a file path"),
    "compare_ops": (
        "BATCHGEN_WORKER_KV_COMPARE_OPS",
        "--kv-compare-ops",
        f"a comma list of {', '.join(KV_OPS)}",
    ),
    "load_failure": ("BATCHGEN_WORKER_KV_LOAD_FAILURE", "--kv-load-failure", "recompute, fail"),
    "compare_budget": (
        "BATCHGEN_WORKER_KV_COMPARE_BUDGET",
        "--kv-compare-budget",
        "a fraction of step time in (0, 1), e.g. 0.02, or off",
    ),
    "compare_breaker_errors": (
        "BATCHGEN_WORKER_KV_COMPARE_BREAKER_ERRORS",
        "--kv-compare-breaker-errors",
        "an integer >= 1, or off",
    ),
    "compare_breaker_seconds": (
        "BATCHGEN_WORKER_KV_COMPARE_BREAKER_SECONDS",
        "--kv-compare-breaker-seconds",
        "seconds > 0, or off",
    ),
    "verify": ("BATCHGEN_WORKER_KV_VERIFY", "--kv-verify", "off, sample, all"),
    "compare_demo_bug": (
        "BATCHGEN_WORKER_KV_COMPARE_DEMO_BUG",
        "--kv-compare-demo-bug",
        f"off, {', '.join(DEMO_BUGS)}",
    ),
}


# Compare mode's production settings: validate, sweep, explore and minimize refuse them.
PRODUCTION_FIELDS = ("compare_budget", "compare_breaker_errors", "compare_breaker_seconds")
# gate_config's breaker where neither the environment nor the CLI sets it: generous, so that only
# a harness in trouble trips it
BREAKER_DEFAULTS = {"compare_breaker_errors": 10, "compare_breaker_seconds": 1.0}


class GateError(ValueError):
    """A bad ``BATCHGEN_WORKER_KV_*`` name or value (or its CLI option)."""


class KvGateConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Literal["plan", "legacy"] = "plan"
    compare: Literal["off", "log", "raise"] = "off"
    compare_sample: float = Field(default=1.0, gt=0.0, le=1.0)
    compare_log: str = Field(default="kv-divergences.jsonl", min_length=1)
    compare_ops: tuple[str, ...] = KV_OPS
    # None: keep the engine config's policy
    load_failure: Literal["recompute", "fail"] | None = None
    # page-content oracle (batchgen.engine.kv_verify): every step, the compare-sampled ones, or none
    verify: Literal["off", "sample", "all"] = "off"
    # compare mode's share of step time it may take (compare.budget); None: no budget
    compare_budget: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False)
    # the breaker (compare.breaker): harness errors in a row, seconds of one op; None: no limit
    compare_breaker_errors: int | None = Field(default=None, ge=1)
    compare_breaker_seconds: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    # a known bug planted in the shadow path (batchgen.kv.known_bugs); None: none
    compare_demo_bug: Literal[DEMO_BUGS] | None = None

    @field_validator(*PRODUCTION_FIELDS, "compare_demo_bug", mode="before")
    @classmethod
    def _off_is_none(cls, value):
        return None if isinstance(value, str) and value.strip().lower() == "off" else value

    @field_validator("compare_ops", mode="before")
    @classmethod
    def _parse_ops(cls, value):
        if isinstance(value, str):
            value = [op.strip() for op in value.split(",") if op.strip()]
        unknown = [op for op in value if op not in KV_OPS]
        if unknown or not value:
            raise ValueError(f"unknown ops {unknown}" if unknown else "no ops named")
        return tuple(op for op in KV_OPS if op in value)

    @field_validator("compare_log")
    @classmethod
    def _log_is_a_file_path(cls, value: str) -> str:
        path = Path(value)
        if path.is_dir():
            raise ValueError(f"{value} is a directory")
        blocker = next(
            (parent for parent in path.parents if parent.exists() and not parent.is_dir()), None
        )
        if blocker is not None:
            raise ValueError(f"{blocker} is not a directory")
        return value

    @property
    def shadow_path(self) -> str:
        return "legacy" if self.path == "plan" else "plan"


def gate_config(
    environ: Mapping[str, str], cli: Mapping[str, object] | None = None
) -> KvGateConfig:
    """Parse the gate family from ``environ``, then apply CLI values (not None) on top; the
    breaker's settings neither sets are ``BREAKER_DEFAULTS``."""
    check_family_names(environ, {env for env, _, _ in GATE_FLAGS.values()}, ENV_PREFIX, GateError)
    values: dict[str, object] = dict(BREAKER_DEFAULTS)
    sources: dict[str, str] = {}
    for field, (env, _, _) in GATE_FLAGS.items():
        if env in environ:
            values[field], sources[field] = environ[env], env
    # a bad value there is refused even where an option overrides it
    from_environment = _validated(values, sources)
    overrides = {field: value for field, value in (cli or {}).items() if value is not None}
    unknown = [field for field in cli or {} if field not in GATE_FLAGS]
    if unknown:
        raise GateError(f"unknown gate option {unknown[0]!r}; known: {', '.join(GATE_FLAGS)}")
    if not overrides:
        return from_environment
    values.update(overrides)
    sources.update({field: GATE_FLAGS[field][1] for field in overrides})
    return _validated(values, sources)


def check_family_names(
    environ: Mapping[str, str], known: Collection[str], prefix: str, error: type[Exception]
) -> None:
    """``error`` naming the first name of ``environ`` in the family ``prefix`` that is not one of
    ``known``, or a typo of the prefix close to one of them (``BATCHGEN_WORKERS_KV_PATH``), with
    the closest valid name and the valid ones. Pure."""
    for name in environ:
        # names are case-sensitive: batchgen_worker_kv_path would be ignored, unnoticed
        upper = name.upper()
        if name in known or not upper.startswith("BATCHGEN_"):
            continue
        cutoff = 0.6 if upper.startswith(prefix) else 0.85
        close = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=cutoff)
        if upper.startswith(prefix) or close:
            case_only = upper != name and upper in known  # the right name, in the wrong case
            hint = (
                f" (did you mean {close[0]}?{' names are upper-case' if case_only else ''})"
                if close
                else ""
            )
            raise error(f"unknown variable {name}{hint}; valid names: {', '.join(sorted(known))}")


def _validated(values: Mapping[str, object], sources: Mapping[str, str]) -> KvGateConfig:
    """``KvGateConfig(**values)``, or GateError naming the first bad value's source (variable or
    option), the allowed values and the closest one."""
    try:
        return KvGateConfig(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0])
        env, _, allowed = GATE_FLAGS[field]
        source = sources.get(field, env)
        if field == "compare_ops":  # suggest for the first unknown op of the list
            given = values.get(field)
            ops = given.split(",") if isinstance(given, str) else list(given or ())
            unknown = [op.strip() for op in ops if op.strip() and op.strip() not in KV_OPS]
            close = difflib.get_close_matches(unknown[0].lower(), KV_OPS, n=1) if unknown else []
        else:
            has_choices = field in ("path", "compare", "load_failure", "verify", "compare_demo_bug")
            choices = allowed.split(", ") if has_choices else []
            close = difflib.get_close_matches(str(values.get(field)).lower(), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        reason = error["msg"].removeprefix("Value error, ")
        raise GateError(
            f"{source}={values.get(field)!r} is invalid ({reason}); allowed: {allowed}{hint}"
        ) from None


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
