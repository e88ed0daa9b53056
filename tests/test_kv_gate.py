"""The BATCHGEN_WORKER_KV_* gate: defaults, parsing, precedence, errors, and the lazy legacy
import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.kv.gate import (
    GATE_FLAGS,
    KV_OPS,
    GateError,
    KvGateConfig,
    build_kv_path,
    gate_config,
)
from compare.gates import BREAKER_DEFAULTS

ENV = {field: env for field, (env, _, _) in GATE_FLAGS.items()}
CLI = {field: option for field, (_, option, _) in GATE_FLAGS.items()}
REPO_ROOT = Path(__file__).resolve().parents[1]


# ---- defaults and parsing ---------------------------------------------------------------------
def test_an_empty_environment_gives_the_documented_defaults():
    config = gate_config({})
    # a production worker's breaker is on; a gate built in code (validate's, sweep's) has none
    assert config == KvGateConfig(**BREAKER_DEFAULTS)
    assert (KvGateConfig().compare_breaker_errors, KvGateConfig().compare_breaker_seconds) == (
        None,
        None,
    )
    assert (config.compare_budget, config.compare_breaker_errors) == (None, 10)
    assert (
        config.path,
        config.compare,
        config.compare_sample,
        config.compare_log,
        config.compare_ops,
    ) == ("plan", "off", 1.0, "kv-divergences.jsonl", KV_OPS)
    assert config.shadow_path == "legacy"


def test_variables_outside_the_family_are_ignored():
    assert gate_config(
        {"PATH": "/usr/bin", "BATCHGEN_SEED": "3", "BATCHGEN_WORKER_OTHER": "x"}
    ) == KvGateConfig(**BREAKER_DEFAULTS)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("path", "legacy", "legacy"),
        ("path", "plan", "plan"),
        ("compare", "log", "log"),
        ("compare", "raise", "raise"),
        ("compare_sample", "0.25", 0.25),
        ("compare_sample", "1", 1.0),
        ("compare_log", "/tmp/divergences.jsonl", "/tmp/divergences.jsonl"),
        ("compare_ops", "evict", ("evict",)),
        # canonical op order, duplicates collapse
        ("compare_ops", "alloc, poll,alloc", ("poll", "alloc")),
        ("load_failure", "fail", "fail"),
        ("compare_budget", "0.02", 0.02),
        ("compare_budget", "off", None),
        ("compare_breaker_errors", "3", 3),
        ("compare_breaker_errors", "OFF", None),
        ("compare_breaker_seconds", "0.25", 0.25),
        ("compare_breaker_seconds", "off", None),
        ("compare_demo_bug", "reversed-grants", "reversed-grants"),
        ("compare_demo_bug", "off", None),
    ],
)
def test_each_variable_is_parsed_into_its_field(field, value, expected):
    assert getattr(gate_config({ENV[field]: value}), field) == expected


def test_the_shadow_is_the_other_path():
    assert gate_config({ENV["path"]: "legacy", ENV["compare"]: "raise"}).shadow_path == "plan"
    assert gate_config({ENV["compare"]: "log"}).shadow_path == "legacy"


# ---- precedence -------------------------------------------------------------------------------
PRECEDENCE = [  # field, environment value, CLI value, parsed CLI value
    ("path", "legacy", "plan", "plan"),
    ("compare", "log", "raise", "raise"),
    ("compare_sample", "0.5", 0.25, 0.25),
    ("compare_log", "env.jsonl", "cli.jsonl", "cli.jsonl"),
    ("compare_ops", "poll", "migrate,evict", ("evict", "migrate")),
    ("load_failure", "fail", "recompute", "recompute"),
    ("prefix_cache", "off", "on", "on"),
    ("verify", "all", "sample", "sample"),
    ("compare_budget", "0.05", 0.02, 0.02),
    ("compare_breaker_errors", "5", 3, 3),
    ("compare_breaker_seconds", "0.5", "2.5", 2.5),
    ("compare_demo_bug", "reversed-grants", "evict-at-watermark", "evict-at-watermark"),
]


def test_precedence_cases_cover_every_flag():
    assert {case[0] for case in PRECEDENCE} == set(GATE_FLAGS)


@pytest.mark.parametrize(("field", "env_value", "cli_value", "expected"), PRECEDENCE)
def test_the_cli_overrides_the_environment_which_overrides_the_default(
    field, env_value, cli_value, expected
):
    default = getattr(KvGateConfig(), field)
    from_env = getattr(gate_config({ENV[field]: env_value}), field)
    assert from_env != default
    assert getattr(gate_config({ENV[field]: env_value}, {field: cli_value}), field) == expected
    assert getattr(gate_config({}, {field: cli_value}), field) == expected
    # None: option not given
    assert getattr(gate_config({ENV[field]: env_value}, {field: None}), field) == from_env


# ---- errors --------------------------------------------------------------------------------------
def test_an_unknown_family_name_is_rejected_naming_it_and_suggesting_the_closest():
    with pytest.raises(GateError) as raised:
        gate_config({"BATCHGEN_WORKER_KV_PAHT": "plan"})
    message = str(raised.value)
    assert "BATCHGEN_WORKER_KV_PAHT" in message
    assert "did you mean BATCHGEN_WORKER_KV_PATH?" in message
    assert all(env in message for env in ENV.values())  # and lists the valid names


def test_an_unknown_name_is_rejected_even_when_its_value_is_valid_and_other_names_are_fine():
    with pytest.raises(GateError, match="BATCHGEN_WORKER_KV_COMPARE_SAMPLES"):
        gate_config({ENV["path"]: "legacy", "BATCHGEN_WORKER_KV_COMPARE_SAMPLES": "0.5"})


BAD_VALUES = [  # field, bad value, closest valid value (None: none is close)
    ("path", "plna", "plan"),
    ("path", "legacyy", "legacy"),
    ("path", "", None),
    ("compare", "raiss", "raise"),
    ("compare", "lgo", "log"),
    ("compare", "yes", None),
    ("compare_sample", "0", None),
    ("compare_sample", "1.5", None),
    ("compare_sample", "-0.1", None),
    ("compare_sample", "half", None),
    ("compare_sample", "nan", None),
    ("compare_log", "", None),
    ("verify", "sampel", "sample"),
    ("verify", "yes", None),
    ("compare_ops", "", None),
    ("compare_ops", " , ", None),
    ("load_failure", "recompte", "recompute"),
    ("load_failure", "retry", None),
    ("prefix_cache", "of", "off"),
    ("prefix_cache", "yes", None),
    ("compare_budget", "0", None),
    ("compare_budget", "1", None),
    ("compare_budget", "2%", None),
    ("compare_budget", "nan", None),
    ("compare_breaker_errors", "0", None),
    ("compare_breaker_errors", "1.5", None),
    ("compare_breaker_seconds", "-1", None),
    ("compare_breaker_seconds", "inf", None),
    ("compare_demo_bug", "reverse-grants", "reversed-grants"),
    ("compare_demo_bug", "yes", None),
]


def test_bad_value_cases_cover_every_flag():
    assert {case[0] for case in BAD_VALUES} == set(GATE_FLAGS)


@pytest.mark.parametrize(("field", "value", "closest"), BAD_VALUES)
def test_a_bad_value_names_the_variable_the_allowed_values_and_the_closest_valid_value(
    field, value, closest
):
    with pytest.raises(GateError) as raised:
        gate_config({ENV[field]: value})
    message = str(raised.value)
    assert message.startswith(f"{ENV[field]}={value!r} is invalid")
    assert f"allowed: {GATE_FLAGS[field][2]}" in message
    if closest is None:
        assert "did you mean" not in message
    else:
        assert message.endswith(f"did you mean {closest!r}?")


def test_a_misspelt_op_gets_the_closest_op_suggested():
    with pytest.raises(GateError, match=r"did you mean 'evict'\?"):
        gate_config({ENV["compare_ops"]: "poll,evcit"})


@pytest.mark.parametrize(
    ("ops", "closest"),
    [
        (",evcit", "evict"),
        ("poll,,evcit", "evict"),
        ("poll, ,evcit", "evict"),
        ("EVICT", "evict"),
        ("poll,Alloc", "alloc"),
    ],
)
def test_a_misspelt_op_after_an_empty_item_or_in_the_wrong_case_gets_the_closest_op_suggested(
    ops, closest
):
    with pytest.raises(GateError) as raised:
        gate_config({ENV["compare_ops"]: ops})
    assert str(raised.value).endswith(f"did you mean {closest!r}?")


def test_a_misspelt_op_is_rejected_naming_the_variable_and_the_ops():
    with pytest.raises(GateError) as raised:
        gate_config({ENV["compare_ops"]: "poll,evcit"})
    message = str(raised.value)
    assert message.startswith("BATCHGEN_WORKER_KV_COMPARE_OPS='poll,evcit' is invalid")
    assert (
        "evcit" in message
        and "allowed: a comma list of poll, release, evict, migrate, alloc" in message
    )


def test_a_bad_cli_value_names_the_cli_option_not_the_variable():
    with pytest.raises(GateError) as raised:
        gate_config({ENV["path"]: "legacy"}, {"path": "plna"})
    assert str(raised.value).startswith("--kv-path='plna' is invalid")
    assert str(raised.value).endswith("did you mean 'plan'?")


def test_building_an_unknown_path_is_a_gate_error():
    with pytest.raises(GateError, match="unknown KV path 'plans'; allowed: plan, legacy"):
        build_kv_path("plans", None)


# ---- the legacy path is imported only when needed ------------------------------------------------
PROBE = """
import json, os, sys
from batchgen.model.loader import load_model
from batchgen.engine.runner import run_workload
from batchgen.kv.gate import gate_config
from batchgen.engine.workloads import builtin_workload
from batchgen.shadow.wiring import gated_worker

gate = gate_config(os.environ)
workload = builtin_workload("smoke")
worker = gated_worker(load_model("tiny"), cache_config=workload.cache,
                      engine_config=workload.engine, kv_gate=gate)
result = run_workload(worker, workload)
leaked = result.leaked_gpu_pages + result.leaked_host_pages
legacy_loaded = "batchgen.kv.legacy" in sys.modules
print(json.dumps({"legacy_loaded": legacy_loaded, "kv": type(worker._kv).__name__,
                  "released": len(result.outputs), "leaked": leaked}))
"""


def probe(env: dict[str, str], cwd: Path) -> dict:
    clean = {
        name: os.environ[name] for name in ("PATH", "HOME", "LANG", "TMPDIR") if name in os.environ
    }
    clean.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}, **env)
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=clean,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("env", "legacy_loaded", "kv"),
    [
        ({}, False, "PlanKvPath"),
        (
            {"BATCHGEN_WORKER_KV_PATH": "plan", "BATCHGEN_WORKER_KV_COMPARE": "off"},
            False,
            "PlanKvPath",
        ),
        ({"BATCHGEN_WORKER_KV_PATH": "legacy"}, True, "LegacyKvPath"),
    ],
    ids=["default", "plan-compare-off", "legacy"],
)
def test_the_legacy_module_is_loaded_only_when_the_gate_needs_it(env, legacy_loaded, kv, tmp_path):
    assert probe(env, tmp_path) == {
        "legacy_loaded": legacy_loaded,
        "kv": kv,
        "released": 8,
        "leaked": 0,
    }


@pytest.mark.parametrize("name", ["BATCHGEN_WORKERS_KV_PATH", "BATCHGEN_WORKER_KVPATH"])
def test_a_typo_in_the_family_prefix_is_caught_with_the_closest_name(name):
    with pytest.raises(GateError, match=r"did you mean BATCHGEN_WORKER_KV_PATH\?"):
        gate_config({name: "plan"})


@pytest.mark.parametrize("name", ["batchgen_worker_kv_path", "Batchgen_Worker_Kv_Path"])
def test_a_family_name_not_in_upper_case_is_refused_naming_the_upper_case_one(name):
    """Environment names are case-sensitive: read as given, it would be ignored and the default path
    run."""
    with pytest.raises(
        GateError,
        match=rf"^unknown variable {name} \(did you mean BATCHGEN_WORKER_KV_PATH\? names "
        r"are upper-case\); valid names: ",
    ):
        gate_config({name: "legacy"})


def test_a_misspelt_family_name_in_lower_case_gets_no_upper_case_hint():
    with pytest.raises(
        GateError,
        match=r"^unknown variable batchgen_worker_kv_pth \(did you mean "
        r"BATCHGEN_WORKER_KV_PATH\?\); valid names: ",
    ):
        gate_config({"batchgen_worker_kv_pth": "legacy"})


def test_an_unrelated_batchgen_variable_is_left_alone():
    assert gate_config({"BATCHGEN_HOME": "/tmp"}) == gate_config({})


def test_a_value_in_the_wrong_case_gets_the_valid_spelling_suggested():
    with pytest.raises(GateError, match=r"did you mean 'plan'\?"):
        gate_config({"BATCHGEN_WORKER_KV_PATH": "PLAN"})
