"""The divergence log's records: one JSON line each, versioned, with a published JSON Schema.

A log holds `DivergenceRecord`s (one per diverging compared step), a `RunSummary` per run
(how many steps were compared, so reports have a denominator; and, optionally, the run's
`Timeline` of per-step counters the binding chose), and, in runs with a budget or a breaker, a
`SampleRateRecord` per change of the sample rate. Each names its binding (the slice whose paths
it compared, e.g. ``kv``), its run, workload and seed. `parse_record` reads one line back and
says exactly what is wrong with a bad one. ``compare.schema`` publishes their JSON Schema.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compare.budget import RateChange
from compare.observation import Comparison, ShadowStats

SCHEMA_VERSION = 3
SUPPORTED_SCHEMA_VERSIONS = (2, SCHEMA_VERSION)
# the binding of every schema 2 record (written before records named theirs): batchgen's KV ops
SCHEMA_2_BINDING = "kv"
# a \uXXXX escape of a UTF-16 surrogate, paired or not
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class RecordError(ValueError):
    """A log line that is not a valid record of a supported schema version."""


class _Record(BaseModel):
    # Non-finite floats (a NaN a path computed, an infinite pre-state value) are written as NaN,
    # Infinity and -Infinity, as Python's json module does, not as null: they read back as
    # themselves.
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")


class RunKey(NamedTuple):
    """Whose run a record is of: every record's first fields but its type and version."""

    binding: str  # the slice whose paths were compared, e.g. "kv"
    run_id: str
    workload: str
    seed: int


class _RunRecord(_Record):
    """What every line of a log starts with: its type and version, and whose run wrote it."""

    record_type: str  # each record type narrows it to its own name
    schema_version: Literal[3] = SCHEMA_VERSION
    binding: str  # as RunKey says
    run_id: str
    workload: str
    seed: int


class DivergenceRecord(_RunRecord):
    """One compared step where the shadow path diverged from the authoritative path."""

    record_type: Literal["divergence"] = "divergence"
    step: int
    op: str
    authoritative: str  # the path whose result was used, e.g. "plan"
    shadow: str  # the path run on a fork, e.g. "legacy"
    kind: str  # "state", "copies", "exception", "invalid_plan", "data" (bytes an oracle checked)
    field_paths: list[str]  # flattened paths that differ, e.g. "requests[r17].gpu_pages[3]"
    diff: dict  # JSON-safe explanation of the difference (deepdiff over the differing leaves)
    exception: str | None  # "<path> raised <Type>: <message>" for each side that raised
    replay: dict  # opaque: op input + pre-state, whatever the binding needs to replay the op
    created_at: float  # Unix time

    @classmethod
    def from_comparison(
        cls, comparison: Comparison, run: RunKey, *, replay: dict, created_at: float
    ) -> DivergenceRecord:
        """The record of a diverged comparison of ``run`` (ValueError for a matched one). Pure."""
        if comparison.kind is None:
            raise ValueError(f"{comparison.op} step {comparison.step} matched: not a divergence")
        raised = comparison.exceptions
        return cls(
            **run._asdict(),
            step=comparison.step,
            op=comparison.op,
            authoritative=comparison.authoritative.path,
            shadow=comparison.shadow.path,
            kind=comparison.kind,
            field_paths=list(comparison.field_paths),
            diff=comparison.diff.detail if comparison.diff is not None else {},
            exception="; ".join(raised) or None,
            replay=replay,
            created_at=created_at,
        )


class OutcomeCount(_Record):
    """How often a run reached one decision outcome, and the first step that did."""

    count: int
    first_step: int


class Timeline(_Record):
    """Named per-step counters of one run, one value per step, and constant levels to read them
    against. What they count is the binding's business."""

    # the step of each counter's first value, numbered as DivergenceRecord.step numbers them
    first_step: int
    counters: dict[str, list[int]]  # name -> one value per step, from first_step on
    levels: dict[str, int] = {}  # name -> a constant, e.g. a capacity or a threshold

    @model_validator(mode="after")
    def _same_length(self) -> Timeline:
        lengths = {name: len(values) for name, values in self.counters.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"counters hold one value per step, so as many each; found {lengths}")
        return self

    @property
    def num_steps(self) -> int:
        return len(next(iter(self.counters.values()), ()))


class DataChecks(_Record):
    """What a run's data oracle (the binding's check of the bytes both paths move) checked."""

    checked: dict[str, int]  # check -> units checked (e.g. "load" -> pages)
    divergences: dict[str, int]  # check -> divergence records it logged
    # pattern id -> how often the run issued it (e.g. "copy.load.shuffled" -> batches)
    patterns: dict[str, int]
    seconds: float  # the oracle's own time


class RunSummary(_RunRecord):
    """Totals of one run, written when it ends: the denominators of a report."""

    record_type: Literal["run_summary"] = "run_summary"
    authoritative: str
    shadow: str
    steps_compared: dict[str, int]  # per op
    divergences: dict[str, int]  # per op
    harness_errors: int
    compare_seconds: float  # harness time on top of the authoritative path
    authoritative_seconds: float  # time in the authoritative path on compared steps
    # why the run stopped before its work was done ("Type: message"); None: it was done
    # decision outcome id -> how often the run's compared ops reached it (compare.coverage)
    coverage: dict[str, OutcomeCount] = {}
    stopped_by: str | None = None
    timeline: Timeline | None = None  # None: the run recorded none
    # the step whose op tripped the breaker: nothing compared from there on; left out when None
    breaker_step: int | None = Field(default=None, exclude_if=lambda step: step is None)
    data: DataChecks | None = None  # None: the run had no data oracle

    @classmethod
    def from_stats(
        cls,
        stats: ShadowStats,
        run: RunKey,
        *,
        authoritative: str,
        shadow: str,
        stopped_by: str | None = None,
        timeline: Timeline | None = None,
        data: DataChecks | None = None,
        breaker_step: int | None = None,
    ) -> RunSummary:
        """The summary of ``run`` from its executor's counters, its ``timeline`` and its data
        oracle's ``data``. Pure."""
        return cls(
            **run._asdict(),
            authoritative=authoritative,
            shadow=shadow,
            steps_compared=dict(stats.num_compared),
            divergences=dict(stats.num_divergences),
            harness_errors=stats.num_harness_errors,
            compare_seconds=stats.compare_seconds,
            authoritative_seconds=stats.authoritative_seconds,
            coverage={
                outcome: OutcomeCount(count=tally.count, first_step=tally.first_step)
                for outcome, tally in stats.coverage.items()
            },
            stopped_by=stopped_by,
            timeline=timeline,
            data=data,
            breaker_step=breaker_step,
        )


class SampleRateRecord(_RunRecord):
    """A change of a run's sample rate (``compare.budget``, ``compare.breaker``): from ``step`` on
    the run compares the fraction ``new_rate`` of its steps (0: compare mode is off for the rest of
    the run, and for the rest of ``step`` too). A reader of the log knows from these which steps
    were compared. Only runs with a budget or a breaker write them."""

    record_type: Literal["sample_rate"] = "sample_rate"
    step: int
    old_rate: float
    new_rate: float
    cause: Literal["budget", "breaker"]
    reason: str  # what was measured, in words
    share: float | None  # the moving share of step time that decided a budget change
    created_at: float  # Unix time

    @classmethod
    def from_change(cls, change: RateChange, run: RunKey, *, created_at: float) -> SampleRateRecord:
        """The record of one rate change of ``run``. Pure."""
        return cls(
            **run._asdict(),
            step=change.step,
            old_rate=change.old_rate,
            new_rate=change.new_rate,
            cause=change.cause,
            reason=change.reason,
            share=change.share,
            created_at=created_at,
        )


LogRecord = Annotated[
    DivergenceRecord | RunSummary | SampleRateRecord, Field(discriminator="record_type")
]

_MODELS: dict[str, type[_RunRecord]] = {
    "divergence": DivergenceRecord,
    "run_summary": RunSummary,
    "sample_rate": SampleRateRecord,
}


def parse_record(line: str) -> LogRecord:
    """Parse one log line (a schema 2 record as schema 3, of binding ``SCHEMA_2_BINDING``);
    RecordError says what is wrong (JSON, type, version, fields). Pure."""
    data = _json_object(line)
    record_type = data.get("record_type")
    if record_type not in _MODELS:
        raise RecordError(
            f"unknown record_type {record_type!r}; known: "
            + ", ".join(repr(name) for name in _MODELS)
        )
    version = data.get("schema_version")
    if version is None:
        raise RecordError(f"a {record_type} record without schema_version")
    if type(version) is not int or version not in SUPPORTED_SCHEMA_VERSIONS:  # true == 1 to Python
        supported = ", ".join(str(v) for v in SUPPORTED_SCHEMA_VERSIONS)
        raise RecordError(
            f"unsupported schema_version {version!r} in a {record_type} record; "
            f"this reader supports {supported}"
        )
    if version == 2:  # read as schema 3: the same fields, its binding the only one there was
        data = {**data, "schema_version": SCHEMA_VERSION, "binding": SCHEMA_2_BINDING}
    try:
        # as the schema types say: no "7" for 7
        return _MODELS[record_type].model_validate(data, strict=True)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc']) or '<record>'}: "
            f"{problem['msg'].lower()}"
            for problem in error.errors()
        )
        raise RecordError(f"invalid {record_type} record: {problems}") from None


def _json_object(line: str) -> dict:
    """The JSON object of one line, all its strings Unicode text; RecordError otherwise. Pure."""
    try:
        data: Any = json.loads(line)
    except json.JSONDecodeError as error:
        raise RecordError(f"not JSON: {error}") from None
    except RecursionError:
        raise RecordError(
            "not JSON this reader can parse: arrays or objects nest too deeply"
        ) from None
    if not isinstance(data, dict):
        raise RecordError(f"expected a JSON object, found {type(data).__name__}")
    # json reads an unpaired one into a str that is no Unicode text
    if _SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as error:
            raise RecordError(
                f"a string holds the unpaired surrogate \\u{ord(error.object[error.start]):04x}, "
                "which is no Unicode character; surrogates must come in pairs"
            ) from None
    return data
