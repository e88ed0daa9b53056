from typing import ClassVar, Literal

import pytest
from pydantic import Field, field_validator

from compare import BREAKER_DEFAULTS, CompareGate, GateError, GateFamily, off_is_none


class SchedulerGate(CompareGate):
    PATHS: ClassVar[tuple[str, str]] = ("planner", "legacy")
    OPS: ClassVar[tuple[str, ...]] = ("admit", "preempt")

    path: Literal["planner", "legacy"] = "planner"
    compare_log: str = Field(default="sched-divergences.jsonl", min_length=1)
    compare_ops: tuple[str, ...] = ("admit", "preempt")
    policy: Literal["fcfs", "lof"] = "fcfs"  # a field of the slice's own
    compare_demo_bug: Literal["lifo"] | None = None

    @field_validator("compare_demo_bug", mode="before")
    @classmethod
    def _no_demo_bug(cls, value):
        return off_is_none(value)


GATES = GateFamily(
    "BATCHGEN_WORKER_SCHED_",
    "--sched-",
    SchedulerGate,
    {"policy": "fcfs, lof", "compare_demo_bug": "off, lifo"},
)


def test_each_field_is_a_variable_and_an_option_named_from_the_prefixes():
    assert GATES.flags == {
        "path": ("BATCHGEN_WORKER_SCHED_PATH", "--sched-path", "planner, legacy"),
        "compare": ("BATCHGEN_WORKER_SCHED_COMPARE", "--sched-compare", "off, log, raise"),
        "compare_sample": (
            "BATCHGEN_WORKER_SCHED_COMPARE_SAMPLE",
            "--sched-compare-sample",
            "a float in (0, 1]",
        ),
        "compare_log": ("BATCHGEN_WORKER_SCHED_COMPARE_LOG", "--sched-compare-log", "a file path"),
        "compare_ops": (
            "BATCHGEN_WORKER_SCHED_COMPARE_OPS",
            "--sched-compare-ops",
            "a comma list of admit, preempt",
        ),
        "compare_budget": (
            "BATCHGEN_WORKER_SCHED_COMPARE_BUDGET",
            "--sched-compare-budget",
            "a fraction of step time in (0, 1), e.g. 0.02, or off",
        ),
        "compare_breaker_errors": (
            "BATCHGEN_WORKER_SCHED_COMPARE_BREAKER_ERRORS",
            "--sched-compare-breaker-errors",
            "an integer >= 1, or off",
        ),
        "compare_breaker_seconds": (
            "BATCHGEN_WORKER_SCHED_COMPARE_BREAKER_SECONDS",
            "--sched-compare-breaker-seconds",
            "seconds > 0, or off",
        ),
        "policy": ("BATCHGEN_WORKER_SCHED_POLICY", "--sched-policy", "fcfs, lof"),
        "compare_demo_bug": (
            "BATCHGEN_WORKER_SCHED_COMPARE_DEMO_BUG",
            "--sched-compare-demo-bug",
            "off, lifo",
        ),
    }


def test_an_empty_environment_gives_the_defaults_and_a_production_breaker():
    assert GATES.parse({}) == SchedulerGate(**BREAKER_DEFAULTS)
    assert (GATES.parse({}).path, GATES.parse({}).shadow_path) == ("planner", "legacy")


def test_the_cli_overrides_the_environment():
    environ = {"BATCHGEN_WORKER_SCHED_PATH": "legacy", "BATCHGEN_WORKER_SCHED_COMPARE_OPS": "admit"}
    gate = GATES.parse(environ, {"path": "planner", "compare_ops": None, "policy": "lof"})
    assert (gate.path, gate.shadow_path, gate.compare_ops, gate.policy) == (
        "planner",
        "legacy",
        ("admit",),
        "lof",
    )


def test_off_turns_an_extra_setting_off():
    assert GATES.parse({"BATCHGEN_WORKER_SCHED_COMPARE_DEMO_BUG": "OFF"}).compare_demo_bug is None


def test_a_misspelt_name_gets_the_closest_valid_name():
    with pytest.raises(
        GateError, match=r"^unknown variable BATCHGEN_WORKER_SCHED_POLCY \(did you "
    ):
        GATES.parse({"BATCHGEN_WORKER_SCHED_POLCY": "lof"})


def test_a_bad_value_of_an_added_field_names_the_variable_and_the_closest_value():
    with pytest.raises(GateError) as raised:
        GATES.parse({"BATCHGEN_WORKER_SCHED_POLICY": "lfo"})
    assert str(raised.value) == (
        "BATCHGEN_WORKER_SCHED_POLICY='lfo' is invalid (Input should be 'fcfs' or 'lof');"
        " allowed: fcfs, lof; did you mean 'lof'?"
    )


def test_a_misspelt_op_names_the_option_and_the_closest_op():
    with pytest.raises(GateError) as raised:
        GATES.parse({}, {"compare_ops": "admit,premept"})
    assert str(raised.value) == (
        "--sched-compare-ops='admit,premept' is invalid (unknown ops ['premept']);"
        " allowed: a comma list of admit, preempt; did you mean 'preempt'?"
    )


def test_an_unknown_option_is_refused_naming_the_known_ones():
    with pytest.raises(GateError, match="^unknown gate option 'polcy'; known: path, compare, "):
        GATES.parse({}, {"polcy": "lof"})
