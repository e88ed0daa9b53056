"""``batchgen run``: its summary, help, dtype and scale, stalls, and which KV path ran."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import TWO_REQUESTS, one_json_object, run_json

from batchgen.cli import main
from batchgen.cli import run as run_module
from batchgen.engine import runner
from batchgen.engine.workloads import builtin_workload
from batchgen.kv.gate import ENV_PREFIX
from compare import RunSummary, read_log

RUN_KEYS = {
    "requests",
    "finished_requests",
    "aborted_requests",
    "failed_requests",
    "tokens_generated",
    "tokens_per_s",
    "evictions",
    "loads",
    "recompute_preemptions",
    "peak_gpu_pages",
    "peak_host_pages",
    "leaked_gpu_pages",
    "leaked_host_pages",
    "model",
    "device",
    "seed",
}


def test_run_json_prints_one_object_with_the_run_summary(capsys):
    assert main(["run", "--workload", "smoke", "--json"]) == 0
    summary = one_json_object(capsys.readouterr().out)
    assert RUN_KEYS <= summary.keys()
    assert (
        summary["workload"],
        summary["requests"],
        summary["model"],
        summary["device"],
        summary["seed"],
    ) == ("smoke", 8, "tiny", "cpu", 0)
    assert summary["evictions"] > 0
    assert (
        summary["leaked_gpu_pages"],
        summary["leaked_host_pages"],
        summary["live_requests"],
    ) == (0, 0, 0)


@pytest.mark.parametrize(
    "argv, threads", [([], 1), (["--threads", "2"], 2)], ids=["tiny-default", "explicit"]
)
def test_run_sets_and_reports_the_torch_cpu_threads(argv, threads, capsys):
    assert main(["run", "--workload", "smoke", "--json", *argv]) == 0
    assert one_json_object(capsys.readouterr().out)["threads"] == threads
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)  # the session's setting (conftest)


def test_run_prints_a_summary_table_and_progress_on_stderr(capsys):
    assert main(["run", "--workload", "smoke", "--seed", "2"]) == 0
    captured = capsys.readouterr()
    assert "batchgen run: smoke" in captured.out and "tokens_generated" in captured.out
    assert "8/8 requests released" in captured.err


def test_run_accepts_a_workload_file(tmp_path, capsys):
    path = tmp_path / "two.json"
    workload = builtin_workload("smoke", scale=0.25)
    path.write_text(workload.model_dump_json())
    assert main(["run", "--workload", str(path), "--json"]) == 0
    assert one_json_object(capsys.readouterr().out)["requests"] == 2


def test_run_prints_names_and_paths_with_brackets_as_written(tmp_path, capsys):
    path = tmp_path / "trace[v2].json"
    path.write_text(
        builtin_workload("smoke", scale=0.25)
        .model_copy(update={"name": "trace[/v2]"})
        .model_dump_json()
    )
    log = tmp_path / "log[/x].jsonl"
    assert (
        main(["run", "--workload", str(path), "--kv-compare", "log", "--kv-compare-log", str(log)])
        == 0
    )
    captured = capsys.readouterr()
    assert "batchgen run: trace[/v2]" in captured.out and "trace[/v2]" in captured.err
    assert log.exists()


@pytest.mark.parametrize(
    "command, dtype",
    [
        ("run", "the workload's cache.dtype: a file's, float32 for the built-in workloads"),
        ("validate", "float32"),
    ],
)
def test_help_explains_every_flag_with_its_default(command, dtype, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    flags = [
        ("--model", "tiny"),
        ("--device", "cpu"),
        ("--dtype", dtype),
        ("--seed", "0"),
        ("--scale", "1.0"),
        ("--json", "off"),
        *(
            [("--outputs", "not written"), ("--timeline", "not written")]
            if command == "run"
            else []
        ),
    ]
    for flag, default in flags:
        assert re.search(f"{flag} .*?\\(default: {re.escape(default)}\\)", text), flag
    assert "--dtype {float32,bfloat16,float16}" in text


@pytest.mark.parametrize(
    "file_dtype, flags, dtype",
    [
        ("bfloat16", [], "bfloat16"),
        ("float16", [], "float16"),
        ("bfloat16", ["--dtype", "float32"], "float32"),
        ("float32", ["--dtype", "float16"], "float16"),
    ],
    ids=["file-bfloat16", "file-float16", "flag-over-file", "flag-float16"],
)
def test_run_takes_a_workload_files_cache_dtype_unless_dtype_is_given(
    capsys, monkeypatch, tmp_path, file_dtype, flags, dtype
):
    workload = tmp_path / "two.json"
    workload.write_text(
        json.dumps({**TWO_REQUESTS, "cache": {**TWO_REQUESTS["cache"], "dtype": file_dtype}})
    )
    weights = spy_on_model_dtype(monkeypatch)
    assert main(["run", "--workload", str(workload), "--json", *flags]) == 0
    assert (one_json_object(capsys.readouterr().out)["dtype"], weights) == (
        dtype,
        [getattr(torch, dtype)],
    )


@pytest.mark.parametrize("flags, dtype", [([], "float32"), (["--dtype", "bfloat16"], "bfloat16")])
def test_run_of_a_builtin_workload_is_float32_unless_dtype_is_given(
    capsys, monkeypatch, flags, dtype
):
    weights = spy_on_model_dtype(monkeypatch)
    assert (run_json(capsys, *flags)["dtype"], weights) == (dtype, [getattr(torch, dtype)])


def test_scale_given_with_a_workload_file_is_named_in_a_warning_and_not_reported_as_applied(
    capsys, tmp_path
):
    workload = tmp_path / "two.json"
    workload.write_text(json.dumps(TWO_REQUESTS))
    assert main(["run", "--workload", str(workload), "--scale", "5", "--json"]) == 0
    captured = capsys.readouterr()
    summary = one_json_object(captured.out)
    assert (summary["requests"], summary["scale"]) == (2, 1.0)
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert warnings == [
        "batchgen: warning: --workload is a file, so --scale 5 is ignored and the file runs as "
        "written (--scale applies to the built-in workloads only)"
    ]


@pytest.mark.parametrize(
    "workload, flags, requests, scale",
    [("smoke", ["--scale", "0.5"], 4, 0.5), ("two.json", ["--scale", "1"], 2, 1.0)],
    ids=["builtin", "file-scale-1"],
)
def test_scale_that_applies_or_changes_nothing_warns_nothing(
    capsys, monkeypatch, tmp_path, workload, flags, requests, scale
):
    monkeypatch.chdir(tmp_path)
    Path("two.json").write_text(json.dumps(TWO_REQUESTS))
    assert main(["run", "--workload", workload, "--json", *flags]) == 0
    captured = capsys.readouterr()
    summary = one_json_object(captured.out)
    assert (summary["requests"], summary["scale"]) == (requests, scale)
    assert "warning" not in captured.err


def spy_on_model_dtype(monkeypatch) -> list:
    """The dtype of each model ``batchgen run`` loads, appended as it loads."""
    weights, load = [], run_module.model_from_args

    def spied(*args):
        model = load(*args)
        weights.append(model.model.embed_tokens.weight.dtype)
        return model

    monkeypatch.setattr(run_module, "model_from_args", spied)
    return weights


def test_run_help_names_each_kv_variable_and_shows_the_fault_grammar(capsys):
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    # argparse may break a line after a hyphen
    text = re.sub(r"(?<=\w-) ", "", " ".join(out.split()))
    for flag, env, default in [
        ("--kv-path", "PATH", "plan"),
        ("--kv-compare", "COMPARE", "off"),
        ("--kv-compare-sample", "COMPARE_SAMPLE", "1.0"),
        ("--kv-compare-log", "COMPARE_LOG", "kv-divergences.jsonl"),
        ("--kv-compare-ops", "COMPARE_OPS", "poll,release,evict,migrate,alloc"),
        ("--kv-load-failure", "LOAD_FAILURE", "the workload's engine config"),
    ]:
        assert re.search(
            f"{flag} .*?\\(default: \\$BATCHGEN_WORKER_KV_{env}, else {re.escape(default)}\\)", text
        ), flag
    assert re.search(r"--kv-load-retries N .*?\(default: the workload's engine config\)", text)
    assert re.search(r"--faults SPEC .*?\(default: no faults\)", text)
    assert "    load_fail_late=P       a load fails 1-3 steps after it was issued\n" in out
    assert (
        "    abort_phases=A+B       waiting, prefilling, decoding, swapped, loading (default:"
        " all)\n" in out
    )


@pytest.mark.parametrize("compare", ["off", "log"])
def test_run_that_cannot_progress_exits_1_naming_the_stall(compare, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "MAX_IDLE_STEPS", 300)
    log = tmp_path / "log.jsonl"
    log_flags = ["--kv-compare-log", str(log)] if compare == "log" else []
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--faults",
                "seed=1,gpu_refuse=1",
                "--json",
                "--kv-compare",
                compare,
                *log_flags,
            ]
        )
        == 1
    )
    if compare == "log":  # the stalled run still closes its compare log with a summary
        [summary] = read_log(log).records
        assert (
            isinstance(summary, RunSummary)
            and summary.workload == "smoke"
            and summary.divergences == {}
        )
        assert summary.stopped_by.startswith("RunStalled: smoke: no progress in 300 steps")
    captured = capsys.readouterr()
    stopped = one_json_object(captured.out)
    assert (stopped["workload"], stopped["stopped"]) == ("smoke", "stalled")
    [line] = [line for line in captured.err.splitlines() if line.startswith("batchgen:")]
    assert line == f"batchgen: stalled: {stopped['message']}"
    assert (
        line
        == "batchgen: stalled: smoke: no progress in 300 steps (no token, release, eviction, load"
        " or preemption) with 8 requests live (8 waiting), 0 of 24 GPU pages free (an injected"
        " fault holding the pools, such as gpu_refuse=1, can do this)"
    )


def test_run_past_its_step_limit_exits_1_naming_what_is_live(capsys, monkeypatch):
    """Loads that hang under a timeout longer than the run may take: the step limit stops it, and
    says what is live (LOADING requests) and what can cause it."""
    monkeypatch.setattr(runner, "MAX_STEPS", 200)
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--kv-load-retries",
                "0",
                "--faults",
                "load_hang=1",
                "--kv-load-timeout-steps",
                "100000",
            ]
        )
        == 1
    )
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("batchgen:")]
    assert re.fullmatch(
        r"batchgen: stalled: smoke: not done after 20\d steps \(the limit: its last arrival"
        r" step \+ "
        r"200\) with \d+ requests live \((\d+ [a-z]+, )*\d+ loading(, \d+ [a-z]+)*\), \d+ of 24"
        r" GPU "
        r"pages free \(a load that never lands under a long --kv-load-timeout-steps can do this\)",
        line,
    ), line


def test_version_names_batchgen_and_torch(capsys):
    assert main(["--version"]) == 0
    assert (
        capsys.readouterr().out
        == f"batchgen {importlib.metadata.version('batchgen')} (torch {torch.__version__})\n"
    )


def test_run_says_which_kv_path_ran(capsys):
    summary = run_json(capsys)
    assert (summary["kv_path"], summary["kv_compare"], summary["load_failure"]) == (
        "plan",
        "off",
        "recompute",
    )
    assert (
        summary["finished_requests"],
        summary["aborted_requests"],
        summary["failed_requests"],
    ) == (8, 0, 0)
    assert (
        not {"steps_compared", "divergences", "compare_log", "faults", "fault_aborts"}
        & summary.keys()
    )
    assert run_json(capsys, "--kv-path", "legacy")["kv_path"] == "legacy"


def test_a_plan_run_without_compare_never_imports_the_legacy_path():
    code = (
        "import sys, torch; torch.set_num_threads(1); from batchgen.cli import main; code ="
        " main(['run', '--workload', 'smoke', '--json']); print('legacy imported' if"
        " 'batchgen.kv.legacy' in sys.modules else 'legacy not imported'); sys.exit(code)"
    )
    env = {name: value for name, value in os.environ.items() if not name.startswith(ENV_PREFIX)}
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines()[-1] == "legacy not imported"
