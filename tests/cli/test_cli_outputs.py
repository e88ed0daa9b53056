"""``batchgen run --outputs FILE``: one JSON line per released request, in release order, whole
however the run ends."""

import json
import os
from pathlib import Path

import pytest
from cli_helpers import TWO_REQUESTS, error_line, interrupt_at_step, one_json_object

from batchgen.cli import main
from batchgen.engine.worker import Worker
from compare import JsonlSink


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
