"""The batchgen command: exit codes, JSON, error lines; the KV path flags, faults, report, replay
and minimize.

(``batchgen validate`` is tested with the validation, in test_validation.py.)
"""

import ast
import errno
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from injected_bugs import reversed_grants

from batchgen.cli import main
from batchgen.cli import minimize as minimize_command
from batchgen.cli import run as run_module
from batchgen.cli.outputs import OutputsFile
from batchgen.cli.report import EMPTY, NOTHING_COMPARED, UNENDED
from batchgen.engine import runner
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import builtin_workload, load_workload
from batchgen.exit_codes import Terminated
from batchgen.kv import manager as kv_manager
from batchgen.kv.gate import ENV_PREFIX
from batchgen.kv.plans import AllocPlan, PageGrant
from compare import DivergenceRecord, JsonlSink, RunSummary, read_log


@pytest.fixture(autouse=True)
def no_gate_environment(monkeypatch):
    """Tests start from an environment without BATCHGEN_WORKER_KV_* (they set what they test)."""
    for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)


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


def one_json_object(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


# ---- run -------------------------------------------------------------------------------------
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


@pytest.mark.parametrize(
    "command, flag, default",
    [
        ("validate", "--reports-dir", "reports"),
        ("report", "--format", "text"),
        ("report", "--out", "stdout"),
        ("minimize", "--out-dir", "reports/minimized"),
        ("minimize", "--max-tests", "400"),
    ],
)
def test_help_of_the_log_commands_gives_each_default(command, flag, default, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(f"{flag} .*?\\(default: {re.escape(default)}\\)", text), flag


def test_minimize_help_says_what_an_interrupt_or_a_spent_budget_writes_and_where_to_keep_the_test(
    capsys,
):
    assert main(["minimize", "--help"]) == 0
    # a line may break after a hyphen
    text = re.sub(r"(?<=\w-) ", "", " ".join(capsys.readouterr().out.split()))
    assert (
        "Ctrl-C or SIGTERM during the search writes that smallest workload and its test the same"
        " way, says so, and exits 130 or 143; if no candidate has diverged yet, nothing is written"
        in text
    )
    assert (
        "When --max-tests runs out first, it writes the smallest diverging workload found so far"
        in text
    )
    assert "move both files into tests/ to keep the test" in text


# ---- run: KV path flags, compare mode, faults ----------------------------------------------------
def run_json(capsys, *flags: str) -> dict:
    """``batchgen run --workload smoke --json FLAGS``: its summary."""
    assert main(["run", "--workload", "smoke", "--json", *flags]) == 0
    return one_json_object(capsys.readouterr().out)


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


def interrupt_at_step(monkeypatch, num_steps: int) -> None:
    """Make the worker's ``num_steps``-th step raise KeyboardInterrupt before it runs, as Ctrl-C
    would."""
    worker_step, steps = Worker.step, []

    def step(self):
        steps.append(1)
        if len(steps) == num_steps:
            raise KeyboardInterrupt
        worker_step(self)

    monkeypatch.setattr(Worker, "step", step)


def test_an_interrupted_run_still_ends_its_compare_log_and_exits_130(capsys, monkeypatch, tmp_path):
    log = tmp_path / "log.jsonl"
    interrupt_at_step(monkeypatch, 5)
    assert (
        main(["run", "--workload", "smoke", "--kv-compare", "log", "--kv-compare-log", str(log)])
        == 130
    )
    assert capsys.readouterr().err.strip().endswith("batchgen: interrupted")
    [summary] = read_log(log).records
    assert isinstance(summary, RunSummary) and sum(summary.steps_compared.values()) > 0
    assert summary.stopped_by == "KeyboardInterrupt"
    assert main(["report", str(log)]) == 1  # the run stopped early: its log vouches for nothing
    warning = capsys.readouterr().err.strip()
    assert warning == f"batchgen: warning: {log}: {UNENDED}, so it vouches for nothing compared"


@pytest.mark.parametrize(
    "opener, flags, named",
    [
        ((JsonlSink, "_open"), ["--kv-compare", "log", "--kv-compare-log"], "divergence log"),
        ((OutputsFile, "open"), ["--outputs"], "--outputs"),
    ],
    ids=["compare-log", "outputs"],
)
def test_a_file_that_cannot_be_opened_stops_the_run_before_it_starts(
    capsys, monkeypatch, tmp_path, opener, flags, named
):
    def refused(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(*opener, refused)
    monkeypatch.setattr(Worker, "step", lambda self: pytest.fail("the run started"))
    path = tmp_path / "out.jsonl"
    assert main(["run", "--workload", "smoke", *flags, str(path)]) == 2
    assert (
        error_line(capsys)
        == f"batchgen: error: {named} {path}: cannot open it for writing: Permission denied"
    )


def test_an_os_error_ends_the_command_with_one_line_naming_its_path(capsys, monkeypatch, tmp_path):
    """A path the system refuses is bad input (exit 2), named with the option that gave it; any
    other OSError (a full disk) is a failed run (exit 1). Neither is a traceback."""

    def full_disk(self):
        raise OSError(errno.ENOSPC, "No space left on device", "reports/out.json")

    monkeypatch.setattr(Worker, "step", full_disk)
    assert main(["run", "--workload", "smoke"]) == 1
    assert error_line(capsys) == "batchgen: error: No space left on device: 'reports/out.json'"

    def refused(self):
        raise PermissionError(errno.EACCES, "Permission denied", "ckpt")

    monkeypatch.setattr(Worker, "step", refused)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--workload", "smoke", "--kv-compare", "log", "--kv-compare-log=ckpt"]) == 2
    assert error_line(capsys) == "batchgen: error: --kv-compare-log: Permission denied: 'ckpt'"

    def own_file(self):  # a path batchgen chose itself, not one the command line gave
        raise PermissionError(errno.EACCES, "Permission denied", "/tmp/batchgen-scratch")

    monkeypatch.setattr(Worker, "step", own_file)
    assert main(["run", "--workload", "smoke"]) == 1
    assert error_line(capsys) == "batchgen: error: Permission denied: '/tmp/batchgen-scratch'"

    def invalid(self):  # EINVAL from inside a library, naming no path: not the input's fault
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(Worker, "step", invalid)
    assert main(["run", "--workload", "smoke"]) == 1
    assert error_line(capsys) == "batchgen: error: Invalid argument"


@pytest.mark.skipif(
    not os.path.exists("/dev/full"), reason="needs /dev/full (Linux), a file every write to fails"
)
def test_a_compare_log_that_stops_taking_writes_mid_run_stops_it_with_exit_1(capsys):
    """/dev/full opens, as the run's start checks, and refuses every write: the run summary's, at
    the end."""
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--json",
                "--kv-compare",
                "log",
                "--kv-compare-log",
                "/dev/full",
            ]
        )
        == 1
    )
    captured = capsys.readouterr()
    stopped = one_json_object(captured.out)
    assert (stopped["stopped"], stopped["message"]) == (
        "compare log unwritable",
        "divergence log /dev/full: a write failed: No space left on device",
    )
    assert (
        captured.err.strip().splitlines()[-1]
        == f"batchgen: compare log unwritable: {stopped['message']}"
    )


def test_an_error_that_is_not_the_compare_logs_is_not_blamed_on_it(capsys, monkeypatch, tmp_path):
    def unreadable(self):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(Worker, "step", unreadable)
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--kv-compare",
                "log",
                "--kv-compare-log",
                str(tmp_path / "kv.jsonl"),
            ]
        )
        == 1
    )
    assert error_line(capsys) == "batchgen: error: Input/output error"


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


@pytest.mark.parametrize("output", [["--json"], []], ids=["json", "table"])
def test_a_closed_stdout_ends_the_command_with_one_line_not_a_traceback(output):
    """``batchgen run [--json] | true``: the reader is gone before the result is printed."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(ENV_PREFIX)}
    child = subprocess.Popen(
        [sys.executable, "-m", "batchgen", "run", "--workload", "smoke", *output],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    child.stdout.close()  # before anything is read
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=300) == 1
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1] == "batchgen: stdout was closed before all output was written"


@pytest.mark.parametrize("output", [["--json"], []], ids=["json", "table"])
def test_an_unwritable_stdout_ends_the_command_with_one_line_and_exit_1(output):
    """``batchgen run > /dev/full``: the result cannot be written (as on a full disk)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(ENV_PREFIX)}
    with open("/dev/full", "w") as full:
        child = subprocess.run(
            [sys.executable, "-m", "batchgen", "run", "--workload", "smoke", *output],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env={**env, "OMP_NUM_THREADS": "1"},
        )
    assert child.returncode == 1
    assert "Traceback" not in child.stderr and "Exception ignored" not in child.stderr
    assert (
        child.stderr.splitlines()[-1]
        == "batchgen: cannot write to stdout: No space left on device; files written are whole"
    )


def test_stdout_closed_from_the_start_is_refused_before_any_work():
    """``batchgen run >&-``: the result would vanish and the exit status say 0."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(ENV_PREFIX)}
    child = subprocess.run(
        [sys.executable, "-m", "batchgen", "run", "--workload", "L2-4096", "--json"],
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.close(1),
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert child.returncode == 2
    assert child.stderr.splitlines() == [
        "batchgen: error: stdout is closed; batchgen writes its results there "
        "(redirect it, to /dev/null if they are not wanted)"
    ]


# the start of a probe module that sends the process SIGNUM at one point of a run, once
SIGNAL_PROBES = {
    "while-importing": (
        """
import builtins
real_import = builtins.__import__
def signalling_import(name, *args, **kwargs):
    if name == "numpy":  # inside torch's import, where a raised interrupt would be swallowed
        send()
    return real_import(name, *args, **kwargs)
builtins.__import__ = signalling_import
"""
    ),
    "while-running": (
        """
from batchgen.engine.worker import Worker
real_step = Worker.step
def signalling_step(self):
    if self.state.step == 3:
        send()
    real_step(self)
Worker.step = signalling_step
"""
    ),
}
SEND_ONCE = """
import os, signal
# as started from a terminal: pytest may run with either ignored (a background job ignores SIGINT)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
sent = []
def send():
    if not sent:
        sent.append(SIGNUM)
        os.kill(os.getpid(), SIGNUM)
"""


def run_probe(tmp_path: Path, probe: str, flags: list[str]) -> tuple[int, str]:
    """Run ``probe`` as a module, then ``python -m batchgen run FLAGS`` in the same process: exit
    code, stderr."""
    (tmp_path / "probe.py").write_text(
        probe + "import runpy, sys\n"
        f"sys.argv = ['batchgen', 'run', *{flags!r}]\n"
        "runpy.run_module('batchgen', run_name='__main__')\n"
    )
    env = {name: value for name, value in os.environ.items() if not name.startswith(ENV_PREFIX)}
    root = Path(__file__).resolve().parents[1]
    child = subprocess.run(
        [sys.executable, "-m", "probe"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{tmp_path}{os.pathsep}{root}"},
    )
    assert "Traceback" not in child.stderr, child.stderr
    return child.returncode, child.stderr


@pytest.mark.parametrize("when", sorted(SIGNAL_PROBES))
@pytest.mark.parametrize(
    "signum, code, line, stopped_by",
    [
        (signal.SIGINT, 130, "batchgen: interrupted", "KeyboardInterrupt"),
        (signal.SIGTERM, 143, "batchgen: terminated", "Terminated: SIGTERM"),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_and_sigterm_end_the_command_with_one_line_from_the_first_moment(
    tmp_path, when, signum, code, line, stopped_by
):
    """While torch imports, the process ends at once (nothing is written yet); once the run has
    started, the same cleanup runs first: the compare log ends with the run's summary. SIGTERM is
    how ``timeout`` or a CI runner stops a job."""
    log = tmp_path / "kv.jsonl"
    probe = SEND_ONCE.replace("SIGNUM", f"signal.{signum.name}") + SIGNAL_PROBES[when]
    exit_code, stderr = run_probe(
        tmp_path,
        probe,
        ["--workload", "smoke", "--kv-compare", "log", "--kv-compare-log", str(log)],
    )
    assert (exit_code, stderr.splitlines()[-1]) == (code, line), stderr
    if when == "while-running":
        assert [
            record.stopped_by for record in read_log(log).records if isinstance(record, RunSummary)
        ] == [stopped_by]
    else:
        assert not log.exists()


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_the_process_was_started_ignoring_stays_ignored(tmp_path, name):
    """``nohup`` ignores SIGTERM, a shell's background job SIGINT: such a job runs to the end."""
    probe = (
        SEND_ONCE.replace("SIGNUM", f"signal.{name}")
        + f"signal.signal(signal.{name}, signal.SIG_IGN)\n"
        + SIGNAL_PROBES["while-running"]
    )
    exit_code, stderr = run_probe(tmp_path, probe, ["--workload", "smoke"])
    assert exit_code == 0, stderr


def test_ctrl_c_ending_a_string_exec_still_exits_130_under_python_m(tmp_path):
    """CPython marks a KeyboardInterrupt that ends a string ``exec`` (dataclass creation runs them)
    as unhandled even once caught, and under ``-m`` would then end the process by SIGINT (-2)
    instead of with exit code 130."""
    probe = (
        "from batchgen.engine.worker import Worker\n"
        "Worker.step = lambda self: exec('raise KeyboardInterrupt')\n"
    )
    exit_code, stderr = run_probe(tmp_path, probe, ["--workload", "smoke"])
    assert (exit_code, stderr.splitlines()[-1]) == (130, "batchgen: interrupted"), stderr


def test_the_console_script_is_the_entry_point_that_handles_ctrl_c_while_importing():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"batchgen": "batchgen.__main__:main"}


def test_the_environment_decides_when_an_option_is_absent(capsys, monkeypatch):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_PATH", "legacy")
    monkeypatch.setenv("BATCHGEN_WORKER_KV_LOAD_FAILURE", "fail")
    summary = run_json(capsys)
    assert (summary["kv_path"], summary["load_failure"]) == ("legacy", "fail")


def test_an_option_beats_the_environment(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_PATH", "legacy")
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE", "log")
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE_LOG", str(tmp_path / "env.jsonl"))
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE_OPS", "alloc,evict")
    summary = run_json(
        capsys,
        "--kv-path",
        "plan",
        "--kv-compare-log",
        str(tmp_path / "cli.jsonl"),
        "--kv-compare-ops",
        "alloc",
    )
    assert (summary["kv_path"], summary["kv_shadow_path"], summary["kv_compare"]) == (
        "plan",
        "legacy",
        "log",
    )
    assert (summary["kv_compare_ops"], list(summary["steps_compared"])) == (["alloc"], ["alloc"])
    assert summary["compare_log"] == str(tmp_path / "cli.jsonl")
    assert (tmp_path / "cli.jsonl").exists() and not (tmp_path / "env.jsonl").exists()


@pytest.mark.parametrize(
    "environment, message",
    [
        (
            {"BATCHGEN_WORKER_KV_PAHT": "plan"},
            (
                "batchgen: error: unknown variable BATCHGEN_WORKER_KV_PAHT (did you mean"
                " BATCHGEN_WORKER_KV_PATH?); valid names: BATCHGEN_WORKER_KV_COMPARE,"
                " BATCHGEN_WORKER_KV_COMPARE_LOG, BATCHGEN_WORKER_KV_COMPARE_OPS,"
                " BATCHGEN_WORKER_KV_COMPARE_SAMPLE, BATCHGEN_WORKER_KV_LOAD_FAILURE,"
                " BATCHGEN_WORKER_KV_PATH"
            ),
        ),
        (
            {"BATCHGEN_WORKER_KV_COMPARE": "yes"},
            (
                "batchgen: error: BATCHGEN_WORKER_KV_COMPARE='yes' is invalid (Input should be"
                " 'off', 'log' or 'raise'); allowed: off, log, raise"
            ),
        ),
    ],
    ids=["unknown-name", "bad-value"],
)
@pytest.mark.parametrize(
    "argv", [["run", "--workload", "smoke"], ["validate"]], ids=["run", "validate"]
)
def test_a_bad_gate_environment_exits_2_naming_the_variable(
    capsys, monkeypatch, environment, message, argv
):
    """``validate`` ignores the gates it is given, but a broken environment still stops it (before
    any model)."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert main(argv) == 2
    assert error_line(capsys) == message


def test_a_bad_gate_variable_is_refused_even_where_an_option_overrides_it(capsys, monkeypatch):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_PATH", "shadow")
    assert main(["run", "--workload", "smoke", "--kv-path", "plan"]) == 2
    assert (
        error_line(capsys)
        == "batchgen: error: BATCHGEN_WORKER_KV_PATH='shadow' is invalid (Input should be "
        "'plan' or 'legacy'); allowed: plan, legacy"
    )


def test_compare_settings_given_while_compare_is_off_are_named_in_a_warning(
    capsys, monkeypatch, tmp_path
):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE_OPS", "alloc")
    assert (
        main(
            ["run", "--workload", "smoke", "--json", "--kv-compare-log", str(tmp_path / "kv.jsonl")]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert (
        one_json_object(captured.out)["kv_compare"] == "off"
        and not (tmp_path / "kv.jsonl").exists()
    )
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert warnings == [
        "batchgen: warning: compare mode is off, so --kv-compare-log,"
        " BATCHGEN_WORKER_KV_COMPARE_OPS are ignored and no divergence log is written (--kv-compare"
        " log or raise turns it on)"
    ]


def test_a_compare_log_path_naming_a_file_that_is_no_log_exits_2_and_leaves_it(capsys, tmp_path):
    workload = tmp_path / "smoke.json"
    workload.write_text(builtin_workload("smoke", scale=0.25).model_dump_json())
    before = workload.read_bytes()
    assert (
        main(
            ["run", "--workload", "smoke", "--kv-compare", "log", "--kv-compare-log", str(workload)]
        )
        == 2
    )
    assert (
        error_line(capsys)
        == f"batchgen: error: {workload}: not a divergence log (its first line is no "
        "record), so nothing is appended to it; name a new file or an existing log"
    )
    assert workload.read_bytes() == before


def test_compare_mode_reports_steps_compared_per_op_and_divergences(capsys, tmp_path):
    log = tmp_path / "kv.jsonl"
    summary = run_json(
        capsys, "--kv-path", "legacy", "--kv-compare", "log", "--kv-compare-log", str(log)
    )
    assert (summary["kv_path"], summary["kv_shadow_path"], summary["compare_log"]) == (
        "legacy",
        "plan",
        str(log),
    )
    assert sorted(summary["steps_compared"]) == ["alloc", "evict", "migrate", "poll", "release"]
    assert all(count > 0 for count in summary["steps_compared"].values())
    assert (summary["divergences"], summary["divergences_by_op"], summary["harness_errors"]) == (
        0,
        {},
        0,
    )
    [record] = read_log(log).records
    assert isinstance(record, RunSummary) and record.steps_compared == summary["steps_compared"]


def test_compare_ops_and_sample_limit_what_is_compared(capsys, tmp_path):
    full = run_json(capsys, "--kv-compare", "log", "--kv-compare-log", str(tmp_path / "all.jsonl"))
    some = run_json(
        capsys,
        "--kv-compare",
        "log",
        "--kv-compare-log",
        str(tmp_path / "some.jsonl"),
        "--kv-compare-ops",
        "evict,alloc",
        "--kv-compare-sample",
        "0.5",
    )
    assert sorted(some["steps_compared"]) == ["alloc", "evict"]
    assert 0 < some["steps_compared"]["alloc"] < full["steps_compared"]["alloc"]


def test_compare_mode_divergences_are_counted_per_op_in_the_table(capsys, tmp_path, monkeypatch):
    reversed_grants(monkeypatch)
    log = tmp_path / "kv.jsonl"
    assert (
        main(["run", "--workload", "smoke", "--kv-compare", "log", "--kv-compare-log", str(log)])
        == 0
    )
    out = capsys.readouterr().out
    records = [r for r in read_log(log).records if isinstance(r, DivergenceRecord)]
    assert records
    assert re.search(rf"│ divergences +│ +{len(records)} │", out)
    assert re.search(rf"│ divergences_by_op +│ +alloc {len(records)} │", out)
    assert re.search(
        r"│ steps_compared +│ +alloc \d+, evict \d+, migrate \d+, poll \d+, release \d+ │", out
    )


def test_compare_mode_raise_stops_at_the_first_divergence_with_exit_1(
    capsys, tmp_path, monkeypatch
):
    reversed_grants(monkeypatch)
    log = tmp_path / "kv.jsonl"
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--kv-path",
                "legacy",
                "--kv-compare",
                "raise",
                "--kv-compare-log",
                str(log),
            ]
        )
        == 1
    )
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("batchgen:")]
    assert line.startswith(
        "batchgen: divergence: alloc step 0: state divergence, shadow 'plan' vs authoritative "
        "'legacy'; paths: pools.gpu[0].page_ids[0], "
    )
    assert line.endswith(f"(compare log: {log})")
    record, summary = read_log(log).records  # the run still ends with its summary record
    assert (record.op, record.step) == ("alloc", 0)
    assert isinstance(summary, RunSummary) and summary.divergences == {"alloc": 1}


@pytest.mark.parametrize("compare", ["off", "log", "raise"])
def test_a_plan_the_plan_path_rejects_stops_the_run_with_exit_1(
    compare, capsys, monkeypatch, tmp_path
):
    correct = kv_manager.KVCacheManager.plan_allocation

    def one_page_too_many(self, req):
        plan = correct(self, req)
        return AllocPlan(
            tuple(PageGrant(g.uuid, (*g.new_page_ids, 10**6)) for g in plan.grants),
            plan.not_fitting,
        )

    monkeypatch.setattr(kv_manager.KVCacheManager, "plan_allocation", one_page_too_many)
    log = tmp_path / "kv.jsonl"
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--json",
                "--kv-compare",
                compare,
                "--kv-compare-log",
                str(log),
            ]
        )
        == 1
    )
    captured = capsys.readouterr()
    stopped = one_json_object(captured.out)
    assert (stopped["workload"], stopped["stopped"]) == ("smoke", "plan rejected")
    assert stopped["message"].startswith("AllocPlan.grants[0].new_page_ids: ")
    assert captured.err.strip().splitlines()[-1] == f"batchgen: plan rejected: {stopped['message']}"
    # logged as an invalid_plan divergence, and the run closed with its summary
    if compare != "off":
        assert stopped["message"].endswith(f"(compare log: {log})")
        record, summary = read_log(log).records
        assert record.kind == "invalid_plan" and summary.stopped_by.startswith("PlanRejected: ")


def test_faults_and_load_options_reach_the_worker(capsys):
    summary = run_json(
        capsys,
        "--faults",
        "seed=1,load_fail=1",
        "--kv-load-retries",
        "0",
        "--kv-load-failure",
        "fail",
        "--kv-load-timeout-steps",
        "3",
    )
    assert (
        summary["max_load_retries"],
        summary["load_timeout_steps"],
        summary["load_failure"],
    ) == (0, 3, "fail")
    assert (summary["faults"], summary["fault_aborts"]) == ("seed=1,load_fail=1", 0)
    # no retry: each fails
    assert 0 < summary["loads"] == summary["load_failures"] == summary["failed_requests"]
    retried = run_json(
        capsys,
        "--faults",
        "seed=1,load_fail=1",
        "--kv-load-retries",
        "2",
        "--kv-load-failure",
        "fail",
    )
    assert 0 < retried["load_failures"] == 3 * retried["failed_requests"]
    aborted = run_json(capsys, "--faults", "seed=3,abort=0.3")
    assert aborted["fault_aborts"] > 0 and aborted["failed_requests"] == 0
    assert aborted["aborted_requests"] == aborted["fault_aborts"]
    assert aborted["finished_requests"] == 8 - aborted["fault_aborts"]


def test_run_counts_its_requests_as_finished_aborted_and_failed(capsys, tmp_path):
    workload = tmp_path / "two.json"
    workload.write_text(json.dumps(TWO_REQUESTS))  # "b" is aborted at its abort_step
    assert main(["run", "--workload", str(workload), "--json"]) == 0
    summary = one_json_object(capsys.readouterr().out)
    assert list(summary)[:5] == [
        "workload",
        "requests",
        "finished_requests",
        "aborted_requests",
        "failed_requests",
    ]
    assert [summary[key] for key in list(summary)[1:5]] == [2, 1, 1, 0]
    assert main(["run", "--workload", str(workload)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"│ finished_requests +│ +1 │", out) and re.search(
        r"│ aborted_requests +│ +1 │", out
    )
    assert re.search(r"│ failed_requests +│ +0 │", out)


@pytest.mark.parametrize("output", [["--json"], []], ids=["json", "table"])
def test_a_run_where_requests_failed_warns_how_many_and_why_and_exits_0(output, capsys):
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--faults",
                "load_fail=1",
                "--kv-load-failure",
                "fail",
                *output,
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert warnings == [
        "batchgen: warning: 2 of 8 requests failed: load failed: LoadFault: injected load fail (2);"
        " the run still exits 0 (failed_requests counts them, --outputs names each)"
    ]
    if output:
        summary = one_json_object(captured.out)
        assert (
            summary["finished_requests"],
            summary["aborted_requests"],
            summary["failed_requests"],
        ) == (6, 0, 2)
    else:
        assert re.search(r"│ failed_requests +│ +2 │", captured.out)


def test_a_run_without_failed_requests_warns_nothing(capsys):
    assert main(["run", "--workload", "smoke", "--json", "--faults", "seed=3,abort=0.3"]) == 0
    assert "warning" not in capsys.readouterr().err


# ---- run: --outputs ----------------------------------------------------------------------------
TWO_REQUESTS = {
    "name": "two",
    "cache": {"page_size": 4, "num_gpu_pages": 16, "num_host_pages": 4},
    "requests": [
        {"uuid": "a", "prompt_ids": [1, 2, 3], "max_new_tokens": 5},
        {
            "uuid": "b",
            "prompt_ids": [4, 5],
            "max_new_tokens": 9,
            "arrival_step": 1,
            "abort_step": 3,
        },
    ],
}


def test_run_outputs_writes_each_released_request_as_one_json_line_in_release_order(
    capsys, tmp_path
):
    workload = tmp_path / "two.json"
    workload.write_text(json.dumps(TWO_REQUESTS))
    outputs = tmp_path / "out" / "outputs.jsonl"  # its directory is created
    assert main(["run", "--workload", str(workload), "--outputs", str(outputs), "--json"]) == 0
    assert one_json_object(capsys.readouterr().out)["requests"] == 2
    assert (
        outputs.read_text()
        == '{"uuid": "b", "phase": "finished", "finish_reason": "abort", "output_ids": [48, 356,'
        ' 48]}\n{"uuid": "a", "phase": "finished", "finish_reason": "length", "output_ids":'
        " [142, 382, 416, 138, 269]}\n"
    )


def test_run_outputs_replaces_an_existing_file(capsys, tmp_path):
    outputs = tmp_path / "outputs.jsonl"
    outputs.write_text("an older run's outputs, longer than this run's\n" * 100)
    assert main(["run", "--workload", "smoke", "--outputs", str(outputs)]) == 0
    lines = [json.loads(line) for line in outputs.read_text().splitlines()]
    assert sorted(line["uuid"] for line in lines) == [f"smoke-r{i}" for i in range(8)]


def test_run_outputs_of_failed_requests_name_the_failure(capsys, tmp_path):
    outputs = tmp_path / "outputs.jsonl"
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--faults",
                "load_fail=1",
                "--kv-load-failure",
                "fail",
                "--outputs",
                str(outputs),
            ]
        )
        == 0
    )
    failed = [
        line
        for line in map(json.loads, outputs.read_text().splitlines())
        if line["phase"] == "failed"
    ]
    assert failed == [
        {
            "uuid": "smoke-r4",
            "phase": "failed",
            "finish_reason": "load failed: LoadFault: injected load fail",
            "output_ids": [20],
        },
        {
            "uuid": "smoke-r2",
            "phase": "failed",
            "finish_reason": "load failed: LoadFault: injected load fail",
            "output_ids": [427, 54, 446, 241, 475, 203],
        },
    ]


def test_an_interrupted_run_leaves_a_whole_line_for_each_request_released_before_it(
    capsys, monkeypatch, tmp_path
):
    complete, interrupted = tmp_path / "complete.jsonl", tmp_path / "interrupted.jsonl"
    assert main(["run", "--workload", "smoke", "--outputs", str(complete)]) == 0
    interrupt_at_step(monkeypatch, 30)
    assert main(["run", "--workload", "smoke", "--outputs", str(interrupted)]) == 130
    assert capsys.readouterr().err.strip().endswith("batchgen: interrupted")
    lines, all_lines = (
        interrupted.read_text().splitlines(keepends=True),
        complete.read_text().splitlines(keepends=True),
    )
    assert 0 < len(lines) < len(all_lines) == 8
    assert lines == all_lines[: len(lines)]


@pytest.mark.parametrize(
    "path, reason",
    [
        ("", "--outputs is empty; name a file"),
        (".", "--outputs .: cannot write the outputs: Is a directory"),
        ("new/", "--outputs new/: cannot write the outputs: Is a directory"),
        (
            "two.json/outputs.jsonl",
            (
                "--outputs two.json/outputs.jsonl: cannot write the outputs: two.json is not a "
                "directory"
            ),
        ),
        (
            "two.json",
            (
                "--outputs two.json: it is the workload file (two.json); name another file for the"
                " outputs"
            ),
        ),
        (
            "./kv.jsonl",
            (
                "--outputs ./kv.jsonl: it is the divergence log (kv.jsonl); name another file for"
                " the outputs"
            ),
        ),
    ],
    ids=["empty", "directory", "trailing-slash", "under-a-file", "workload-file", "divergence-log"],
)
def test_run_outputs_that_cannot_be_written_exits_2_before_the_model_loads(
    capsys, monkeypatch, tmp_path, path, reason
):
    monkeypatch.chdir(tmp_path)
    Path("two.json").write_text(json.dumps(TWO_REQUESTS))
    monkeypatch.setattr(
        "batchgen.cli.run.model_from_args", lambda *args: pytest.fail("the model loaded")
    )
    assert (
        main(
            [
                "run",
                "--workload",
                "two.json",
                "--kv-compare",
                "log",
                "--kv-compare-log",
                "kv.jsonl",
                "--outputs",
                path,
            ]
        )
        == 2
    )
    assert error_line(capsys) == f"batchgen: error: {reason}"
    assert (
        json.loads(Path("two.json").read_text()) == TWO_REQUESTS and not Path("kv.jsonl").exists()
    )


def test_run_outputs_in_a_directory_that_is_not_writable_exits_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for a user other than root
    assert main(["run", "--workload", "smoke", "--outputs", str(tmp_path / "outputs.jsonl")]) == 2
    assert (
        error_line(capsys)
        == f"batchgen: error: --outputs {tmp_path / 'outputs.jsonl'}: cannot write the "
        f"outputs: {tmp_path} is not writable"
    )


def test_run_outputs_naming_standard_output_exits_2(capsys, monkeypatch, tmp_path):
    """The summary (and with --json its one object) goes to standard output: the outputs would be
    written over."""
    monkeypatch.setattr(Worker, "step", lambda self: pytest.fail("the run started"))
    stdout_file = tmp_path / "stdout.txt"
    monkeypatch.setattr(
        os, "fstat", lambda fd, fstat=os.fstat: fstat(fd) if fd != 1 else os.stat(stdout_file)
    )
    stdout_file.write_text("")
    assert main(["run", "--workload", "smoke", "--json", "--outputs", str(stdout_file)]) == 2
    assert (
        error_line(capsys)
        == f"batchgen: error: --outputs {stdout_file}: it is standard output, where results "
        "go; name a file for the outputs"
    )


def test_run_outputs_that_cannot_be_opened_leave_nothing_behind(capsys, tmp_path):
    outputs, log = tmp_path / "new" / "sub" / ("a" * 300), tmp_path / "kv.jsonl"
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--outputs",
                str(outputs),
                "--kv-compare",
                "log",
                "--kv-compare-log",
                str(log),
            ]
        )
        == 2
    )
    assert "cannot open it for writing: File name too long" in error_line(capsys)
    assert list(tmp_path.iterdir()) == []  # neither the new directories nor the divergence log


def test_an_unwritable_compare_log_leaves_an_earlier_outputs_file_whole(
    capsys, monkeypatch, tmp_path
):
    def refused(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(JsonlSink, "_open", refused)
    earlier, created = tmp_path / "earlier.jsonl", tmp_path / "new" / "outputs.jsonl"
    earlier.write_text('{"uuid": "kept"}\n')
    for outputs in (earlier, created):
        assert (
            main(
                [
                    "run",
                    "--workload",
                    "smoke",
                    "--kv-compare",
                    "log",
                    "--kv-compare-log",
                    str(tmp_path / "kv.jsonl"),
                    "--outputs",
                    str(outputs),
                ]
            )
            == 2
        )
        capsys.readouterr()
    assert earlier.read_text() == '{"uuid": "kept"}\n' and not (tmp_path / "new").exists()


@pytest.mark.skipif(
    not os.path.exists("/dev/full"), reason="needs /dev/full (Linux), a file every write to fails"
)
def test_run_outputs_that_stop_taking_writes_mid_run_stop_it_with_exit_1(capsys):
    assert main(["run", "--workload", "smoke", "--json", "--outputs", "/dev/full"]) == 1
    captured = capsys.readouterr()
    stopped = one_json_object(captured.out)
    assert (stopped["stopped"], stopped["message"]) == (
        "outputs file unwritable",
        "outputs file /dev/full: a write failed: No space left on device",
    )
    assert (
        captured.err.strip().splitlines()[-1]
        == f"batchgen: outputs file unwritable: {stopped['message']}"
    )


# ---- bad input -------------------------------------------------------------------------------
def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["run", "--workload", "L2-1024"],
            (
                "batchgen: error: unknown workload 'L2-1024'; built-in workloads are smoke,"
                " L2-2048, L2-4096, or give the path of a workload JSON file"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--model", "llama3"],
            (
                "batchgen: error: unknown model name 'llama3'; known names: tiny,"
                " llama2-7b-geometry; or pass an HF-format model directory (config.json +"
                " *.safetensors)"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--scale", "-1"],
            (
                "batchgen: error: argument --scale: must be a number in (0, 1000], got '-1' (see"
                " 'batchgen run --help')"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--scale", "nan"],
            (
                "batchgen: error: argument --scale: must be a number in (0, 1000], got 'nan' (see"
                " 'batchgen run --help')"
            ),
        ),
        (
            ["validate", "--scale", "0"],
            (
                "batchgen: error: argument --scale: must be a number in (0, 1000], got '0' (see"
                " 'batchgen validate --help')"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--seed", "-3"],
            (
                "batchgen: error: argument --seed: must be an integer >= 0, got '-3' (see 'batchgen"
                " run --help')"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--dtype", "float64"],
            "batchgen: error: argument --dtype: invalid choice: 'float64' (choose from ",
        ),
        (
            ["run"],
            (
                "batchgen: error: the following arguments are required: --workload (see 'batchgen"
                " run --help')"
            ),
        ),
        (["serve"], "batchgen: error: argument COMMAND: invalid choice: 'serve' (choose from "),
        (
            ["run", "--workload", "smoke", "--kv-path", "lgacy"],
            (
                "batchgen: error: --kv-path='lgacy' is invalid (Input should be 'plan' or"
                " 'legacy'); allowed: plan, legacy; did you mean 'legacy'?"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--kv-compare", "shadow"],
            (
                "batchgen: error: --kv-compare='shadow' is invalid (Input should be 'off', 'log' or"
                " 'raise'); allowed: off, log, raise"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--kv-compare-sample", "0"],
            (
                "batchgen: error: --kv-compare-sample='0' is invalid (Input should be greater than"
                " 0); allowed: a float in (0, 1]"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--kv-compare-ops", "alloc,free"],
            (
                "batchgen: error: --kv-compare-ops='alloc,free' is invalid (unknown ops ['free']); "
                "allowed: a comma list of poll, release, evict, migrate, alloc"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--kv-load-failure", "retry"],
            (
                "batchgen: error: --kv-load-failure='retry' is invalid (Input should be 'recompute'"
                " or 'fail'); allowed: recompute, fail"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--kv-load-retries", "-1"],
            (
                "batchgen: error: argument --kv-load-retries: must be an integer >= 0, got '-1'"
                " (see 'batchgen run --help')"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--kv-load-timeout-steps", "0"],
            (
                "batchgen: error: argument --kv-load-timeout-steps: must be an integer >= 1, got"
                " '0' (see 'batchgen run --help')"
            ),
        ),
        (
            ["run", "--workload", "smoke", "--faults", "load_fail=2"],
            "batchgen: error: --faults: load_fail=2 must be a probability in [0, 1]",
        ),
        (
            ["run", "--workload", "smoke", "--faults", "load_fial=0.1"],
            (
                "batchgen: error: --faults: 'load_fial=0.1' is not KEY=VALUE with KEY one of abort,"
                " abort_phases, "
            ),
        ),
        (
            ["report"],
            (
                "batchgen: error: the following arguments are required: LOG (see 'batchgen report"
                " --help')"
            ),
        ),
        (
            ["report", "x.jsonl", "--format", "pdf"],
            "batchgen: error: argument --format: invalid choice: 'pdf' ",
        ),
        (
            ["replay", "x.jsonl"],
            (
                "batchgen: error: the following arguments are required: --index (see 'batchgen"
                " replay --help')"
            ),
        ),
        (
            ["minimize", "x.jsonl", "--index", "-1"],
            (
                "batchgen: error: argument --index: must be an integer >= 0, got '-1' (see"
                " 'batchgen minimize --help')"
            ),
        ),
    ],
    ids=[
        "unknown-workload",
        "unknown-model",
        "negative-scale",
        "nan-scale",
        "zero-scale",
        "negative-seed",
        "unknown-dtype",
        "no-workload",
        "unknown-command",
        "kv-path-typo",
        "kv-compare-mode",
        "kv-compare-sample",
        "kv-compare-ops",
        "kv-load-failure",
        "kv-load-retries",
        "kv-load-timeout",
        "faults-probability",
        "faults-key",
        "report-no-log",
        "report-format",
        "replay-no-index",
        "minimize-negative-index",
    ],
)
def test_bad_input_exits_2_with_one_error_line(capsys, argv, message):
    assert main(argv) == 2
    # argparse words its choice lists per Python version
    assert error_line(capsys).startswith(message)


def test_malformed_workload_file_exits_2(tmp_path, capsys):
    path = tmp_path / "broken.json"
    path.write_text('{"name": ')
    assert main(["run", "--workload", str(path)]) == 2
    assert (
        error_line(capsys)
        == f"batchgen: error: workload file '{path}' is not valid JSON: Expecting value "
        "(line 1, column 10)"
    )


def test_workload_request_the_model_cannot_serve_exits_2(tmp_path, capsys):
    path = tmp_path / "vocab.json"
    workload = builtin_workload("smoke", scale=0.25)
    bad = workload.model_copy(
        update={"requests": [workload.requests[0].model_copy(update={"prompt_ids": [1, 600]})]}
    )
    path.write_text(bad.model_dump_json())
    assert main(["run", "--workload", str(path)]) == 2
    assert (
        error_line(capsys)
        == "batchgen: error: request 'smoke-r0': token ids [600] outside the vocabulary [0, 512)"
    )


def test_model_directory_without_config_exits_2(tmp_path, capsys):
    assert main(["run", "--workload", "smoke", "--model", str(tmp_path)]) == 2
    assert (
        error_line(capsys)
        == f"batchgen: error: {tmp_path}/config.json: missing; a model directory needs "
        "config.json next to its safetensors files"
    )


def test_cuda_without_cuda_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["validate", "--device", "cuda"]) == 2
    assert (
        error_line(capsys)
        == "batchgen: error: --device cuda: CUDA is not available on this machine; "
        "allowed here: --device cpu"
    )


# ---- report ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> tuple:
    """Two smoke runs in compare mode (legacy serving, plan shadowed): a clean log, and one with
    alloc divergences."""
    directory = tmp_path_factory.mktemp("logs")
    clean, buggy = directory / "clean.jsonl", directory / "buggy.jsonl"
    flags = [
        "run",
        "--workload",
        "smoke",
        "--kv-path",
        "legacy",
        "--kv-compare",
        "log",
        "--json",
        "--kv-compare-log",
    ]
    assert main([*flags, str(clean)]) == 0
    with pytest.MonkeyPatch.context() as monkeypatch:
        reversed_grants(monkeypatch)
        assert main([*flags, str(buggy)]) == 0
    return clean, buggy


def num_divergences(log) -> int:
    return sum(isinstance(record, DivergenceRecord) for record in read_log(log).records)


def test_report_exits_0_without_divergences_and_1_with_them(logs, capsys):
    clean, buggy = logs
    assert main(["report", str(clean)]) == 0
    assert capsys.readouterr().out.startswith("0 divergences in ")
    assert main(["report", str(buggy)]) == 1
    assert capsys.readouterr().out.startswith(f"{num_divergences(buggy)} divergences in ")


def test_report_exits_1_when_the_harness_failed_though_nothing_diverged(tmp_path, capsys):
    log = tmp_path / "harness.jsonl"
    JsonlSink(log).write(
        RunSummary(
            run_id="r",
            workload="smoke",
            seed=0,
            authoritative="plan",
            shadow="legacy",
            steps_compared={"alloc": 9},
            divergences={},
            harness_errors=3,
            compare_seconds=0.1,
            authoritative_seconds=0.2,
        )
    )
    assert main(["report", str(log)]) == 1
    assert capsys.readouterr().out.startswith("0 divergences in 9 compared ops, 3 harness errors")


@pytest.mark.parametrize("content", ["", "TORN"], ids=["no-summary", "torn-last-line"])
def test_report_fails_naming_a_log_where_a_run_did_not_end(logs, capsys, tmp_path, content):
    clean, buggy = logs
    unended = tmp_path / "unended.jsonl"  # a run that died having logged no divergence
    unended.write_text(
        clean.read_text() + '{"record_type": "divergence", "sche' if content == "TORN" else ""
    )
    assert main(["report", str(clean), str(unended), "--format", "json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["num_divergences"] == 0  # the report is still rendered
    warning = (
        f"batchgen: warning: {unended}: {UNENDED if content else EMPTY}, so it vouches for nothing"
        " compared"
    )
    assert captured.err.strip().splitlines()[-1] == warning
    assert main(["report", str(buggy), str(unended)]) == 1  # with divergences too
    captured = capsys.readouterr()
    assert captured.out.startswith(f"{num_divergences(buggy)} divergences in ")
    assert captured.err.strip().splitlines()[-1] == warning


def test_report_fails_naming_a_log_where_a_run_died_before_another_appended_to_it(
    logs, capsys, tmp_path
):
    clean, buggy = logs
    died = [
        line
        for line in buggy.read_text().splitlines(keepends=True)
        if '"record_type":"divergence"' in line.replace(" ", "")
    ]  # its divergences, and no summary: the run was killed
    shared = tmp_path / "shared.jsonl"
    # a later run appended to the same log and ended
    shared.write_text("".join(died) + clean.read_text())
    assert died and isinstance(read_log(shared).records[-1], RunSummary)

    assert main(["report", str(shared), "--format", "json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["num_divergences"] == len(died)
    assert (
        captured.err.strip().splitlines()[-1]
        == f"batchgen: warning: {shared}: {UNENDED}, so it vouches for nothing compared"
    )


@pytest.mark.parametrize("format_", ["text", "md", "junit", "json"])
def test_report_renders_each_format(logs, capsys, format_):
    _, buggy = logs
    assert main(["report", str(buggy), "--format", format_]) == 1
    out = capsys.readouterr().out
    count = num_divergences(buggy)
    if format_ == "text":
        assert "By op" in out and "By field path" in out and "requests[*].gpu_page_ids[*]" in out
    elif format_ == "md":
        assert out.startswith(f"### {count} divergences in ") and "| alloc |" in out
    elif format_ == "junit":
        suite = ET.fromstring(out).find("testsuite")
        [failed] = [case for case in suite.iter("testcase") if case.find("failure") is not None]
        assert (failed.get("name"), suite.get("failures")) == ("smoke.alloc", "1")
    else:
        assert json.loads(out)["num_divergences"] == count


def test_report_merges_logs(logs, capsys):
    clean, buggy = logs
    assert main(["report", str(clean), str(buggy), "--format", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["num_runs"], report["num_divergences"]) == (2, num_divergences(buggy))


def test_report_reads_a_log_named_twice_once_with_a_warning(logs, capsys, monkeypatch):
    clean, buggy = logs
    monkeypatch.chdir(buggy.parent)
    assert main(["report", "buggy.jsonl", str(clean), f"./{buggy.name}", "--format", "json"]) == 1
    captured = capsys.readouterr()
    assert (json.loads(captured.out)["num_runs"], json.loads(captured.out)["num_divergences"]) == (
        2,
        num_divergences(buggy),
    )
    assert (
        captured.err
        == "batchgen: warning: ./buggy.jsonl: the same file as buggy.jsonl, given again; read"
        " once\n"
    )


def test_report_fails_a_log_whose_runs_compared_nothing(capsys, tmp_path):
    log = tmp_path / "sampled-nothing.jsonl"
    assert (
        main(
            [
                "run",
                "--workload",
                "smoke",
                "--kv-compare",
                "log",
                "--kv-compare-sample",
                "1e-9",
                "--kv-compare-log",
                str(log),
            ]
        )
        == 0
    )
    capsys.readouterr()
    [summary] = read_log(log).records
    assert (
        isinstance(summary, RunSummary)
        and summary.stopped_by is None
        and not any(summary.steps_compared.values())
    )
    assert main(["report", str(log)]) == 1  # a CI gate over it would pass on nothing
    captured = capsys.readouterr()
    assert captured.out.startswith("0 divergences in 0 compared ops\n")
    assert (
        captured.err.strip()
        == f"batchgen: warning: {log}: {NOTHING_COMPARED}, so it vouches for nothing"
    )


@pytest.mark.skipif(not os.path.exists("/dev/stdin"), reason="needs /dev/stdin")
def test_report_reads_a_log_piped_to_dev_stdin(logs):
    clean, buggy = logs
    for log, code, headline in (
        (clean, 0, "0 divergences in "),
        (buggy, 1, f"{num_divergences(buggy)} divergences in "),
    ):
        child = subprocess.run(
            [sys.executable, "-m", "batchgen", "report", "/dev/stdin"],
            input=log.read_bytes(),
            capture_output=True,
            timeout=120,
        )
        assert (child.returncode, child.stderr) == (code, b"")
        assert child.stdout.decode().startswith(headline)


def test_report_out_writes_the_file_instead_of_stdout(logs, capsys, tmp_path):
    _, buggy = logs
    out = tmp_path / "ci" / "divergences.xml"
    assert main(["report", str(buggy), "--format", "junit", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(
        rf"batchgen: wrote {re.escape(str(out))}: {num_divergences(buggy)} divergences in "
        r"\d+ compared ops",
        captured.err.strip(),
    )
    assert ET.parse(out).getroot().tag == "testsuites"


@pytest.mark.parametrize(
    "out, reason",
    [("log.jsonl/report.md", "log.jsonl is not a directory"), ("reports", "Is a directory")],
    ids=["under-a-file", "a-directory"],
)
def test_report_out_that_cannot_be_written_exits_2_saying_why(
    logs, capsys, monkeypatch, tmp_path, out, reason
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").mkdir()
    (tmp_path / "log.jsonl").write_bytes(logs[1].read_bytes())
    assert main(["report", "log.jsonl", "--out", out]) == 2
    assert error_line(capsys) == f"batchgen: error: --out {out}: cannot write the report: {reason}"


def test_report_md_is_appended_to_the_github_step_summary(logs, capsys, monkeypatch, tmp_path):
    _, buggy = logs
    summary = tmp_path / "step-summary.md"
    summary.write_text("## earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert main(["report", str(buggy), "--format", "md"]) == 1
    markdown = capsys.readouterr().out
    assert summary.read_text() == "## earlier step\n" + markdown
    assert main(["report", str(buggy), "--format", "junit"]) == 1  # only md goes to the summary
    assert summary.read_text() == "## earlier step\n" + markdown


@pytest.mark.parametrize("which, verdict", [(0, 0), (1, 1)], ids=["clean", "buggy"])
def test_report_whose_step_summary_cannot_be_appended_warns_and_keeps_its_verdict(
    logs, capsys, monkeypatch, tmp_path, which, verdict
):
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path))  # a directory: cannot be appended to
    assert main(["report", str(logs[which]), "--format", "md"]) == verdict
    captured = capsys.readouterr()
    assert captured.out.startswith("#")  # the report itself, written first
    assert (
        captured.err.splitlines()[-1]
        == f"batchgen: warning: $GITHUB_STEP_SUMMARY={tmp_path}: cannot append "
        "the report: Is a directory"
    )


def test_report_without_step_summary_variable_writes_no_summary(
    logs, capsys, monkeypatch, tmp_path
):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(logs[1]), "--format", "md"]) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content, reason",
    [
        (None, "cannot read divergence log: No such file or directory"),
        (
            '{"record_type": "run_summary"\n',
            "1: not JSON: Expecting ',' delimiter: line 1 column 30 (char 29)",
        ),
        (
            "SUMMARY_V9",
            "1: unsupported schema_version 9 in a run_summary record; this reader supports 2",
        ),
        (
            '{"record_type": "divergence", "schema_version": 2}\n',
            "1: invalid divergence record: run_id: field required",
        ),
    ],
    ids=["missing", "not-json", "unknown-schema-version", "missing-fields"],
)
def test_report_exits_2_naming_the_file_line_and_why(logs, capsys, tmp_path, content, reason):
    path = tmp_path / "bad.jsonl"
    if content == "SUMMARY_V9":
        record = json.loads(logs[0].read_text().splitlines()[0])
        content = json.dumps({**record, "schema_version": 9}) + "\n"
    if content is not None:
        path.write_text(content)
    assert main(["report", str(logs[0]), str(path)]) == 2
    message = error_line(capsys)
    assert message.startswith(
        f"batchgen: error: {path}{':' if content is not None else ': '}{reason}"
    ), message


def test_report_skips_a_torn_last_line_with_a_warning(logs, capsys, tmp_path):
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(logs[1].read_bytes() + b'{"record_type": "divergence", "sche')
    assert main(["report", str(torn), "--format", "json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["num_divergences"] == num_divergences(logs[1])
    warning, unended = captured.err.strip().splitlines()
    assert warning.startswith(f"batchgen: warning: {torn}:") and warning.endswith(
        "; skipped as a torn last line"
    )
    assert unended.startswith(f"batchgen: warning: {torn}: a run in it did not end")


# ---- replay and minimize -----------------------------------------------------------------------
def test_replay_reproduces_a_logged_divergence_while_the_bug_is_there(logs, capsys, monkeypatch):
    _, buggy = logs
    reversed_grants(monkeypatch)
    count = num_divergences(buggy)
    assert main(["replay", str(buggy), "--index", str(count - 1)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        rf"record {count - 1} of {count} divergence records in {re.escape(str(buggy))}: alloc step "
        r"\d+ of smoke \(seed 0, run smoke-\w+\), authoritative legacy, shadow plan",
        lines[0],
    )
    logged = re.fullmatch(r"logged:   state divergence at (\d+) field paths", lines[1])
    assert logged and lines.index(
        f"replayed: state divergence at {logged[1]} field paths"
    ) == 2 + int(logged[1])
    # the field paths, both times
    assert all(line.startswith("    ") for line in lines[2 : 2 + int(logged[1])])
    assert any(line.startswith("    requests[smoke-r") for line in lines[2 : 2 + int(logged[1])])
    assert "diff:" in lines
    assert lines[-1] == "reproduced: yes"


def test_replay_exits_1_once_the_bug_is_fixed(logs, capsys):
    assert main(["replay", str(logs[1]), "--index", "0"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "replayed: no divergence: the two paths agree" in lines and lines[-1] == "reproduced: no"


def test_replay_index_out_of_range_exits_2_naming_the_range(logs, capsys):
    clean, buggy = logs
    count = num_divergences(buggy)
    assert main(["replay", str(buggy), "--index", str(count)]) == 2
    assert (
        error_line(capsys)
        == f"batchgen: error: --index {count} is out of range: {buggy} holds {count} "
        f"divergence records, so --index is 0 to {count - 1} (run summaries are not counted)"
    )
    assert main(["replay", str(clean), "--index", "0"]) == 2
    assert (
        error_line(capsys)
        == f"batchgen: error: {clean}: no divergence record to pick; its 1 records are all run "
        "summaries"
    )


def test_report_on_an_empty_log_exits_1_saying_it_holds_no_record(capsys, tmp_path):
    log = tmp_path / "kv.jsonl"
    log.write_text("")
    assert main(["report", str(log)]) == 1
    assert (
        capsys.readouterr().err
        == f"batchgen: warning: {log}: {EMPTY}, so it vouches for nothing compared\n"
    )


def test_minimize_writes_the_minimal_workload_and_a_regression_test(
    logs, capsys, monkeypatch, tmp_path
):
    reversed_grants(monkeypatch)
    out_dir = tmp_path / "minimized"
    assert main(["minimize", str(logs[1]), "--index", "0", "--out-dir", str(out_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    smoke = builtin_workload("smoke")
    shrink = re.fullmatch(
        r"alloc state divergence \(pools.gpu\[\*\].page_ids\[\*\],"
        r" requests\[\*\].gpu_page_ids\[\*\]\): "
        rf"requests 8 -> 1, new tokens {sum(r.max_new_tokens for r in smoke.requests)} -> 1, "
        r"(\d+) tests run",
        lines[0],
    )
    assert shrink and int(shrink[1]) > 0, lines[0]
    [workload_path] = out_dir.glob("*.json")
    [test_path] = out_dir.glob("test_kv_*.py")
    assert lines[1:] == [f"workload: {workload_path}", f"test:     {test_path}"]
    assert len(load_workload(str(workload_path)).requests) == 1
    tree = ast.parse(test_path.read_text())
    assert [node.name for node in tree.body if isinstance(node, ast.FunctionDef)] == [
        f"test_no_{workload_path.stem}_divergence"
    ]


def test_minimize_exits_1_when_the_divergence_does_not_reproduce(logs, capsys, tmp_path):
    assert (
        main(
            ["minimize", str(logs[1]), "--index", "0", "--out-dir", str(tmp_path / "new" / "tests")]
        )
        == 1
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("batchgen:")]
    assert errors == [
        "batchgen: not reproduced: alloc step 0: workload 'smoke' (seed 0, scale 1.0) shows no"
        " state divergence at pools.gpu[*].page_ids[*], requests[*].gpu_page_ids[*]"
    ]
    assert list(tmp_path.iterdir()) == []


def interrupting_minimize(monkeypatch, num_tests, interrupt):
    """Make ``batchgen minimize``'s search raise ``interrupt`` once its ``num_tests``-th candidate
    has run, as Ctrl-C or SIGTERM would."""
    search = minimize_command.minimize_divergence

    def minimize(record, *, on_test, **kwargs):
        def test_then_interrupt(done, smallest):
            on_test(done, smallest)
            if done == num_tests:
                raise interrupt

        return search(record, on_test=test_then_interrupt, **kwargs)

    monkeypatch.setattr(minimize_command, "minimize_divergence", minimize)


@pytest.mark.parametrize(
    "interrupt, code, last_line",
    [
        (KeyboardInterrupt(), 130, "batchgen: interrupted"),
        (Terminated(), 143, "batchgen: terminated"),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_an_interrupted_minimize_writes_the_smallest_diverging_workload_so_far(
    logs, capsys, monkeypatch, tmp_path, interrupt, code, last_line
):
    reversed_grants(monkeypatch)
    interrupting_minimize(monkeypatch, 2, interrupt)
    out_dir = tmp_path / "new" / "minimized"
    assert main(["minimize", str(logs[1]), "--index", "0", "--out-dir", str(out_dir)]) == code
    captured = capsys.readouterr()
    [workload_path] = out_dir.glob("*.json")
    [test_path] = out_dir.glob("test_kv_*.py")
    assert captured.out.splitlines()[1:] == [f"workload: {workload_path}", f"test:     {test_path}"]
    assert re.fullmatch(
        r"alloc state divergence \(.*\): requests 8 -> 4, new tokens \d+ -> \d+, 2 tests run",
        captured.out.splitlines()[0],
    )
    assert [r.uuid for r in load_workload(str(workload_path)).requests] == [
        f"smoke-r{i}" for i in range(4)
    ]
    errors = [line for line in captured.err.splitlines() if line.startswith("batchgen:")]
    assert errors == [
        (
            "batchgen: minimize was interrupted after 2 tests: the workload written is the smallest"
            " that diverged so far (4 of 8 requests) and may not be minimal; delete its two files"
            " and run minimize again to search to the end"
        ),
        last_line,
    ]


def test_an_interrupted_minimize_that_cannot_write_still_exits_as_interrupted(
    logs, capsys, monkeypatch, tmp_path
):
    def full_disk(out_dir, result):
        raise OSError(errno.ENOSPC, "No space left on device")

    reversed_grants(monkeypatch)
    interrupting_minimize(monkeypatch, 2, KeyboardInterrupt())
    monkeypatch.setattr(minimize_command, "write_regression_into", full_disk)
    assert (
        main(["minimize", str(logs[1]), "--index", "0", "--out-dir", str(tmp_path / "minimized")])
        == 130
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("batchgen:")]
    assert errors == [
        (
            "batchgen: warning: cannot write the smallest diverging workload found: No space left"
            " on device"
        ),
        "batchgen: interrupted",
    ]


def test_minimize_interrupted_before_any_candidate_diverged_writes_nothing(
    logs, capsys, monkeypatch, tmp_path
):
    # the bug is fixed: the first candidate agrees
    interrupting_minimize(monkeypatch, 1, KeyboardInterrupt())
    assert (
        main(
            [
                "minimize",
                str(logs[1]),
                "--index",
                "0",
                "--out-dir",
                str(tmp_path / "new" / "minimized"),
            ]
        )
        == 130
    )
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines()[-1] == "batchgen: interrupted"
    assert list(tmp_path.iterdir()) == []


def test_minimize_warns_when_the_max_tests_budget_runs_out(logs, capsys, monkeypatch, tmp_path):
    reversed_grants(monkeypatch)
    out_dir = tmp_path / "minimized"
    assert (
        main(
            [
                "minimize",
                str(logs[1]),
                "--index",
                "0",
                "--out-dir",
                str(out_dir),
                "--max-tests",
                "3",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert re.fullmatch(
        r"alloc state divergence \(.*\): requests 8 -> 2, new tokens \d+ -> \d+, 3 tests run",
        captured.out.splitlines()[0],
    )
    assert len(list(out_dir.iterdir())) == 2
    errors = [line for line in captured.err.splitlines() if line.startswith(("batchgen:", "/"))]
    assert errors == [
        "batchgen: warning: the --max-tests budget (3) ran out before the search finished: the"
        " workload may not be minimal; delete its two files and rerun with a larger --max-tests"
    ]


def test_minimize_into_the_default_out_dir_says_how_to_keep_the_test(
    logs, capsys, monkeypatch, tmp_path
):
    reversed_grants(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["minimize", str(logs[1]), "--index", "0"]) == 0
    captured = capsys.readouterr()
    [test_path] = (tmp_path / "reports" / "minimized").glob("test_kv_*.py")
    assert captured.out.splitlines()[-1] == f"test:     {test_path.relative_to(tmp_path)}"
    assert (
        captured.err.splitlines()[-1]
        == "batchgen: reports/minimized is git-ignored and `make clean` deletes it: to keep the"
        " regression test, move both files into tests/, where `make test` runs it (it fails"
        " until the bug is fixed)"
    )
