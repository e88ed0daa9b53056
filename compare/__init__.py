"""compare: a generic dual-path ("shadow") comparison harness.

Run an authoritative path and a shadow path of the same operation, compare their canonical
results, log each divergence as a JSON line, and aggregate logs into reports for CI. It knows
nothing of the code it compares (it never imports `batchgen`).

    canonical    canonicalize / flatten / wildcard     plain comparable data and leaf paths
    diff         diff -> Diff                          equal?, differing paths, explanation
    explain      explain -> Row                        each differing path with both values
    observation  Observation, Comparison               one path's outcome; both compared
    shadow       ShadowExecutor                        run both paths, return the authoritative
    experiment   Experiment, Limits                    one run: id, log, records, summary, limits
    gates        CompareGate, GateFamily, GateError    a slice's <PREFIX>* flags -> its config
    sampling     is_sampled_step                       the seeded fraction of steps compared
    errors       DivergenceError, HarnessWarning       what the harness raises and warns
    budget       CompareBudget, RateChange             the sample rate within a cost budget
    breaker      CompareBreaker, BreakerWarning        compare off when the harness misbehaves
    governor     SampleGovernor                        both, over one run's steps
    coverage     Outcome, CoverageCounter              decision outcomes reached, counted
    records      DivergenceRecord, RunSummary, RunKey  the versioned JSON line schema
                 Timeline                              per-step counters of a run
    schema       json_schema, write_json_schema        the log's published JSON Schema
    sink         JsonlSink, read_log(s), write_atomic  durable append, tolerant read
    report       aggregate -> Report                   per op / field path / (workload, op)
    render       render_text, _markdown, _junit, _json  a report for people and for CI
    html         render_html, PageBinding              one HTML page; a binding's charts, replay
    charts       Panel                                 which timeline counters one chart draws
    wording      headline, coverage_line, ...          the lines every format shares
    minimize     ddmin                                 shrink a failing input

Names are imported on first use (PEP 562), so `python -m compare.schema` runs without the
package having imported that module already. `diff` is the exception: the submodule shares the
function's name, and importing the submodule later would rebind `compare.diff` to the module.
"""

import importlib
from typing import Any

from compare.diff import Diff as Diff
from compare.diff import diff as diff

_MODULES = {
    "compare.canonical": ("Keyed", "canonicalize", "flatten", "wildcard"),
    "compare.observation": (
        "Comparison",
        "Observation",
        "ShadowStats",
        "compare_observations",
        "exception_text",
    ),
    "compare.explain": ("Row", "explain", "explain_forms", "explain_record", "row_lines"),
    "compare.shadow": ("ShadowExecutor",),
    "compare.experiment": ("Experiment", "Limits"),
    "compare.gates": (
        "BREAKER_DEFAULTS",
        "PRODUCTION_FIELDS",
        "CompareGate",
        "GateError",
        "GateFamily",
        "check_family_names",
        "off_is_none",
    ),
    "compare.sampling": ("is_sampled_step",),
    "compare.errors": ("DivergenceError", "HarnessWarning"),
    "compare.budget": ("CompareBudget", "RateChange"),
    "compare.breaker": ("BreakerWarning", "CompareBreaker"),
    "compare.governor": ("SampleGovernor",),
    "compare.coverage": ("CoverageCounter", "CoverageRow", "Outcome", "OutcomeTally"),
    "compare.records": (
        "SCHEMA_VERSION",
        "DataChecks",
        "DivergenceRecord",
        "OutcomeCount",
        "LogRecord",
        "RecordError",
        "RunKey",
        "RunSummary",
        "SCHEMA_2_BINDING",
        "SampleRateRecord",
        "Timeline",
        "parse_record",
    ),
    "compare.schema": ("json_schema", "write_json_schema"),
    "compare.sink": (
        "JsonlSink",
        "LogReadResult",
        "LogWriteError",
        "check_log_file",
        "read_log",
        "read_logs",
        "write_atomic",
    ),
    "compare.report": ("Report", "aggregate"),
    "compare.wording": ("coverage_line", "headline"),
    "compare.render": (
        "render_json",
        "render_junit",
        "render_markdown",
        "render_text",
    ),
    "compare.html": ("PageBinding", "render_html"),
    "compare.charts": ("Panel",),
    "compare.minimize": ("ddmin",),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted([*_HOME, "Diff", "diff"])


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'compare' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
