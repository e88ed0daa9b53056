"""The command as a process: a file it cannot open or write, a full disk, stdout closed, Ctrl-C and
SIGTERM from the first moment."""

import errno
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from cli_helpers import error_line, interrupt_at_step, one_json_object

from batchgen.cli import main
from batchgen.cli.outputs import OutputsFile
from batchgen.cli.report import UNENDED
from batchgen.engine.worker import Worker
from batchgen.kv.gate import ENV_PREFIX
from compare import JsonlSink, RunSummary, read_log


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
    root = Path(__file__).resolve().parents[2]
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
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"batchgen": "batchgen.__main__:main"}
