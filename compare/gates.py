"""A slice's env-flag gate: a family of ``<PREFIX>*`` variables, each with a CLI option, parsed
once into a validated, frozen config. Every slice has the same compare settings::

    <PREFIX>PATH                     one of the slice's two paths  default: its first
    <PREFIX>COMPARE                  off, log, raise               default off
    <PREFIX>COMPARE_SAMPLE           float in (0, 1]               default 1.0
    <PREFIX>COMPARE_LOG              path                          default: the slice's
    <PREFIX>COMPARE_OPS              comma list of its ops         default: all
    <PREFIX>COMPARE_BUDGET           fraction in (0, 1) or off     default off
    <PREFIX>COMPARE_BREAKER_ERRORS   int >= 1 or off               default 10 (*)
    <PREFIX>COMPARE_BREAKER_SECONDS  float > 0 or off              default 1.0 (*)

plus the fields the slice's config adds (a `CompareGate` subclass: its paths, ops and log, and
fields of its own, each with its allowed values as messages name them). A field ``compare_x``
is the variable ``<PREFIX>COMPARE_X`` and the option ``<OPTION_PREFIX>compare-x`` (unless the
slice names its option otherwise).

(*) `GateFamily.parse`'s defaults, a production worker's: a config built in code has no breaker
unless it names one, since a validation that stops comparing must not pass.

Precedence: default < environment < CLI option. An unknown name in the family (a typo) or a bad
value (in the environment even where an option overrides it) raises `GateError` naming the
variable, the allowed values and the closest valid name.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Compare mode's production settings (validation commands refuse them).
PRODUCTION_FIELDS = ("compare_budget", "compare_breaker_errors", "compare_breaker_seconds")
# GateFamily.parse's breaker where neither the environment nor the CLI sets it: generous, so that
# only a harness in trouble trips it
BREAKER_DEFAULTS = {"compare_breaker_errors": 10, "compare_breaker_seconds": 1.0}


class GateError(ValueError):
    """A bad name or value in a gate family (or its CLI option)."""


def off_is_none(value):
    """``None`` for the word ``off`` (any case, padded), else ``value``: a setting that can be off.
    Pure."""
    return None if isinstance(value, str) and value.strip().lower() == "off" else value


class CompareGate(BaseModel):
    """The compare settings of one slice's gate. A slice subclasses it, narrowing ``path`` to a
    ``Literal`` of its ``PATHS`` (with a default) and giving ``compare_log`` and ``compare_ops``
    their defaults; fields it adds are its own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    PATHS: ClassVar[tuple[str, str]]  # the slice's two paths, the default authoritative first
    OPS: ClassVar[tuple[str, ...]]  # the ops it compares, in their canonical order

    path: str
    compare: Literal["off", "log", "raise"] = "off"
    compare_sample: float = Field(default=1.0, gt=0.0, le=1.0)
    compare_log: str = Field(min_length=1)
    compare_ops: tuple[str, ...]
    # compare mode's share of step time it may take (compare.budget); None: no budget
    compare_budget: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False)
    # the breaker (compare.breaker): harness errors in a row, seconds of one op; None: no limit
    compare_breaker_errors: int | None = Field(default=None, ge=1)
    compare_breaker_seconds: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)

    @field_validator(*PRODUCTION_FIELDS, mode="before")
    @classmethod
    def _off_is_none(cls, value):
        return off_is_none(value)

    @field_validator("compare_ops", mode="before")
    @classmethod
    def _parse_ops(cls, value):
        if isinstance(value, str):
            value = [op.strip() for op in value.split(",") if op.strip()]
        unknown = [op for op in value if op not in cls.OPS]
        if unknown or not value:
            raise ValueError(f"unknown ops {unknown}" if unknown else "no ops named")
        return tuple(op for op in cls.OPS if op in value)

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
        """The path compare mode runs on a fork: the other one. Pure."""
        first, second = self.PATHS
        return second if self.path == first else first


def _standard_allowed(config: type[CompareGate]) -> dict[str, str]:
    """The allowed values of the settings every gate has, as messages name them. Pure."""
    return {
        "path": ", ".join(config.PATHS),
        "compare": "off, log, raise",
        "compare_sample": "a float in (0, 1]",
        "compare_log": "a file path",
        "compare_ops": f"a comma list of {', '.join(config.OPS)}",
        "compare_budget": "a fraction of step time in (0, 1), e.g. 0.02, or off",
        "compare_breaker_errors": "an integer >= 1, or off",
        "compare_breaker_seconds": "seconds > 0, or off",
    }


class GateFamily:
    """One slice's variables and options: ``flags`` maps each config field to its variable, its
    option and its allowed values. Immutable."""

    def __init__(
        self,
        prefix: str,
        option_prefix: str,
        config: type[CompareGate],
        allowed: Mapping[str, str],
        options: Mapping[str, str] | None = None,
        siblings: Collection[str] = (),
    ):
        """``prefix``: ``BATCHGEN_WORKER_KV_``; ``option_prefix``: ``--kv-``; ``allowed``: the
        allowed values of each field ``config`` adds, in the order its options are listed;
        ``options``: the option of a field named otherwise than ``option_prefix`` + its name (a
        name users know from elsewhere, such as vLLM's ``--enable-prefix-caching``);
        ``siblings``: the prefixes of the other slices' families, whose names are not typos of
        this one's."""
        self.prefix, self.config = prefix, config
        self.siblings = tuple(sibling for sibling in siblings if sibling != prefix)
        every = {**_standard_allowed(config), **allowed}
        order = [field for field in config.model_fields if field not in allowed] + [*allowed]
        named = options or {}
        self.flags = {
            field: (
                prefix + field.upper(),
                named.get(field, option_prefix + field.replace("_", "-")),
                every[field],
            )
            for field in order
        }

    def parse(
        self, environ: Mapping[str, str], cli: Mapping[str, object] | None = None
    ) -> CompareGate:
        """The family's settings in ``environ``, then the CLI's values (not None) on top; the
        breaker's settings neither sets are ``BREAKER_DEFAULTS``. GateError naming a bad name or
        value. Pure."""
        known = {env for env, _, _ in self.flags.values()}
        check_family_names(environ, known, self.prefix, GateError, self.siblings)
        values: dict[str, object] = dict(BREAKER_DEFAULTS)
        sources: dict[str, str] = {}
        for field, (env, _, _) in self.flags.items():
            if env in environ:
                values[field], sources[field] = environ[env], env
        # a bad value there is refused even where an option overrides it
        from_environment = self._validated(values, sources)
        overrides = {field: value for field, value in (cli or {}).items() if value is not None}
        unknown = [field for field in cli or {} if field not in self.flags]
        if unknown:
            known_options = ", ".join(self.flags)
            raise GateError(f"unknown gate option {unknown[0]!r}; known: {known_options}")
        if not overrides:
            return from_environment
        values.update(overrides)
        sources.update({field: self.flags[field][1] for field in overrides})
        return self._validated(values, sources)

    def add_options(self, parser) -> None:
        """One option per field on ``parser`` (an ``argparse`` parser or argument group), default
        None: the environment, then the field's default, decides. Mutates ``parser``."""
        for field, (env, option, allowed) in self.flags.items():
            parser.add_argument(
                option,
                metavar="VALUE",
                default=None,
                help=f"{allowed} (default: ${env}, else {_shown_default(self.config, field)})",
            )

    def parse_options(self, environ: Mapping[str, str], options) -> CompareGate:
        """``parse`` of ``environ`` with the values of the options ``add_options`` added, as
        ``argparse`` left them in ``options`` (a Namespace). GateError naming a bad name or value.
        Pure."""
        given = {
            field: getattr(options, option[2:].replace("-", "_"))
            for field, (_, option, _) in self.flags.items()
        }
        return self.parse(environ, given)

    def _validated(self, values: Mapping[str, object], sources: Mapping[str, str]) -> CompareGate:
        """The config of ``values``, or GateError naming the first bad value's source (variable
        or option), the allowed values and the closest one. Pure."""
        try:
            return self.config(**values)
        except ValidationError as exc:
            error = exc.errors()[0]
            field = str(error["loc"][0])
            env, _, allowed = self.flags[field]
            given = values.get(field)
            hint = _closest_value(self.config, field, given, allowed)
            reason = error["msg"].removeprefix("Value error, ")
            source = sources.get(field, env)
            raise GateError(
                f"{source}={given!r} is invalid ({reason}); allowed: {allowed}"
                + (f"; did you mean {hint!r}?" if hint else "")
            ) from None


def _shown_default(config: type[CompareGate], field: str) -> str:
    """A field's default as an option's help shows it (``off`` for None). Pure."""
    default = BREAKER_DEFAULTS.get(field, config.model_fields[field].default)
    if default is None:
        return "off"
    return ",".join(default) if isinstance(default, tuple) else str(default)


def _closest_value(config: type[CompareGate], field: str, given, allowed: str) -> str | None:
    """The valid value closest to ``given``: for the ops, to its first unknown op; for a field of
    a few values (a ``Literal``), to ``given``; else None. Pure."""
    if field == "compare_ops":
        ops = given.split(",") if isinstance(given, str) else list(given or ())
        unknown = [op.strip() for op in ops if op.strip() and op.strip() not in config.OPS]
        choices, given = (config.OPS, unknown[0]) if unknown else ((), "")
    else:
        choices = allowed.split(", ") if _is_choice(config.model_fields[field].annotation) else ()
    close = difflib.get_close_matches(str(given).lower(), choices, n=1)
    return close[0] if close else None


def _is_choice(annotation) -> bool:
    """Whether a field's type is one of a few values (a ``Literal``, maybe optional). Pure."""
    if typing.get_origin(annotation) is Literal:
        return True
    return any(_is_choice(arg) for arg in typing.get_args(annotation))


def check_family_names(
    environ: Mapping[str, str],
    known: Collection[str],
    prefix: str,
    error: type[Exception],
    siblings: Collection[str] = (),
) -> None:
    """``error`` naming the first name of ``environ`` in the family ``prefix`` that is not one of
    ``known``, or a typo of the prefix close to one of them (``BATCHGEN_WORKERS_KV_PATH``: any
    name that starts with the prefix's first word, but for names nearer the prefix of one of the
    ``siblings`` families: theirs, or their typos), with the closest valid name and the valid
    ones. Pure."""
    root = prefix.split("_", 1)[0] + "_"
    for name in environ:
        # names are case-sensitive: batchgen_worker_kv_path would be ignored, unnoticed
        upper = name.upper()
        if (
            name in known
            or not upper.startswith(root)
            or _nearer_a_sibling(upper, prefix, siblings)
        ):
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


def _nearer_a_sibling(upper: str, prefix: str, siblings: Collection[str]) -> bool:
    """Whether the start of ``upper`` is nearer one of the ``siblings`` prefixes than ``prefix``
    (``BATCHGEN_WORKER_FINSH_COMPARE`` is the finish family's typo, not the KV family's). Pure."""

    def nearness(family: str) -> float:
        return difflib.SequenceMatcher(None, upper[: len(family)], family).ratio()

    return any(nearness(sibling) > nearness(prefix) for sibling in siblings)
