import errno
import json
import math
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from compare.records import DivergenceRecord, RecordError, RunSummary
from compare.sink import JsonlSink, LogReadResult, LogWriteError, read_log, read_logs, write_atomic


def make_record(step, payload=""):
    return DivergenceRecord(
        binding="kv",
        run_id="run-1",
        workload="L2-2048",
        seed=0,
        step=step,
        op="alloc",
        authoritative="plan",
        shadow="legacy",
        kind="state",
        field_paths=[f"requests[r{step}].gpu_pages[0]"],
        diff={},
        exception=None,
        replay={"payload": payload},
        created_at=1.0,
    )


def make_summary():
    return RunSummary(
        binding="kv",
        run_id="run-1",
        workload="L2-2048",
        seed=0,
        authoritative="plan",
        shadow="legacy",
        steps_compared={"alloc": 3},
        divergences={"alloc": 2},
        harness_errors=0,
        compare_seconds=0.1,
        authoritative_seconds=1.0,
    )


def write_log(path, records):
    with JsonlSink(path) as sink:
        for record in records:
            sink.write(record)


def test_appends_one_line_per_record_creating_parent_directories(tmp_path):
    path = tmp_path / "logs" / "run" / "divergences.jsonl"
    write_log(path, [make_record(0), make_summary()])
    write_log(path, [make_record(1)])
    lines = path.read_text().splitlines()
    assert [json.loads(line)["record_type"] for line in lines] == [
        "divergence",
        "run_summary",
        "divergence",
    ]


def test_opens_the_file_only_on_the_first_write(tmp_path):
    path = tmp_path / "divergences.jsonl"
    with JsonlSink(path):
        pass
    assert not path.exists()


def test_every_descriptor_is_closed_exactly_once_with_or_without_close(tmp_path, monkeypatch):
    closes = []
    real_close = os.close

    def counting_close(fd):
        closes.append(fd)
        real_close(fd)

    monkeypatch.setattr(os, "close", counting_close)  # before the sinks register their finalisers
    dropped = JsonlSink(tmp_path / "log.jsonl")
    dropped.write(make_record(0))
    dropped_fd = dropped._fd
    del dropped  # no close(): the record is in the file already; the collector closes it
    assert closes == [dropped_fd]
    closed = JsonlSink(tmp_path / "log.jsonl")
    closed.write(make_record(1))
    closed_fd = closed._fd
    closed.close()
    del closed  # close() detached the finaliser: no second close of a number the OS may reuse
    assert closes == [dropped_fd, closed_fd]
    assert len(read_log(tmp_path / "log.jsonl").records) == 2


def test_reads_back_exactly_what_was_written(tmp_path):
    path = tmp_path / "log.jsonl"
    records = [make_record(0), make_record(1, "ü"), make_summary()]
    write_log(path, records)
    assert read_log(path) == LogReadResult(tuple(records), 3, 0, ())


def test_keeps_every_complete_record_when_the_writer_is_killed_with_sigkill(tmp_path):
    path = tmp_path / "log.jsonl"
    child = textwrap.dedent(f"""
        import sys
        from compare.records import DivergenceRecord
        from compare.sink import JsonlSink
        sink = JsonlSink({str(path)!r})
        for step in range(20000):
            sink.write(DivergenceRecord(
                binding="kv",
                run_id="run-1", workload="w", seed=0, step=step, op="alloc",
                authoritative="plan", shadow="legacy", kind="state", field_paths=[], diff={{}},
                exception=None, replay={{"payload": "x" * 4096}}, created_at=1.0))
            if step == 19:
                print("ready", flush=True)
    """)
    process = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "ready\n"
        time.sleep(0.05)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        process.stdout.close()
    assert process.returncode == -signal.SIGKILL
    result = read_log(path)
    assert result.num_read >= 20
    assert [record.step for record in result.records] == list(range(result.num_read))
    assert result.num_skipped == (0 if path.read_bytes().endswith(b"\n") else 1)


def test_skips_a_torn_last_line_with_a_warning_naming_file_and_line(tmp_path):
    path = tmp_path / "log.jsonl"
    write_log(path, [make_record(0), make_record(1)])
    with open(path, "ab") as file:
        file.write(make_record(2).model_dump_json().encode()[:40])
    result = read_log(path)
    assert [record.step for record in result.records] == [0, 1]
    assert (result.num_read, result.num_skipped) == (2, 1)
    [warning] = result.warnings
    assert warning.startswith(f"{path}:3: not JSON")
    assert warning.endswith("skipped as a torn last line")


def test_skips_a_torn_last_line_cut_inside_a_multibyte_character(tmp_path):
    path = tmp_path / "log.jsonl"
    write_log(path, [make_record(0)])
    line = make_record(1, "é" * 10).model_dump_json().encode()
    with open(path, "ab") as file:
        file.write(line[: line.index("é".encode()) + 1])
    result = read_log(path)
    assert (result.num_read, result.num_skipped) == (1, 1)
    assert "invalid UTF-8" in result.warnings[0]


def test_accepts_a_complete_last_line_without_a_newline(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text(make_record(0).model_dump_json())
    assert read_log(path).num_read == 1


def test_raises_for_a_whole_last_line_without_a_newline_that_is_no_valid_record(tmp_path):
    path = tmp_path / "log.jsonl"  # whole JSON is no write cut short: a newer writer's record, say
    record = {**json.loads(make_summary().model_dump_json()), "schema_version": 4}
    path.write_text(make_record(0).model_dump_json() + "\n" + json.dumps(record))
    with pytest.raises(RecordError, match=rf"^{path}:2: unsupported schema_version 4"):
        read_log(path)


def test_raises_for_a_last_line_without_a_newline_nesting_too_deeply_to_parse(tmp_path):
    # too deep to tell whether it was cut short: named, not skipped as torn
    path = tmp_path / "log.jsonl"
    path.write_text(make_record(0).model_dump_json() + "\n" + "[" * 100_000)
    with pytest.raises(
        RecordError, match=rf"^{path}:2: not JSON this reader can parse: arrays or objects nest"
    ):
        read_log(path)


def test_raises_naming_file_and_line_for_a_bad_line_before_the_last(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text(
        "\n".join([make_record(0).model_dump_json(), "{oops", make_record(1).model_dump_json()])
        + "\n"
    )
    with pytest.raises(RecordError, match=rf"^{path}:2: not JSON"):
        read_log(path)


def test_raises_for_invalid_utf8_before_the_last_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"a": "\xff"}\n' + make_record(0).model_dump_json().encode() + b"\n")
    with pytest.raises(RecordError, match=rf"^{path}:1: invalid UTF-8"):
        read_log(path)


def test_raises_for_a_missing_log(tmp_path):
    with pytest.raises(RecordError, match="cannot read divergence log"):
        read_log(tmp_path / "absent.jsonl")


def test_cuts_a_torn_last_line_off_before_appending(tmp_path):
    path = tmp_path / "log.jsonl"
    write_log(path, [make_record(0)])
    with open(path, "ab") as file:
        file.write(b'{"record_type": "div')
    with pytest.warns(UserWarning, match="cut short"):
        write_log(path, [make_record(2)])
    assert [record.step for record in read_log(path).records] == [0, 2]


def test_cuts_off_a_log_that_is_one_torn_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"record_type": "div')
    with pytest.warns(UserWarning, match="dropping its 20 bytes"):
        write_log(path, [make_record(1)])
    assert [record.step for record in read_log(path).records] == [1]


def test_ends_a_whole_last_record_without_a_newline_instead_of_dropping_it(tmp_path, recwarn):
    path = tmp_path / "log.jsonl"
    path.write_text(make_record(0).model_dump_json() + "\n" + make_summary().model_dump_json())
    write_log(path, [make_record(1)])
    assert [record.record_type for record in read_log(path).records] == [
        "divergence",
        "run_summary",
        "divergence",
    ]
    assert not [w for w in recwarn if "cut short" in str(w.message)]


def test_keeps_a_whole_last_line_without_a_newline_that_is_no_valid_record(tmp_path, recwarn):
    path = tmp_path / "log.jsonl"
    record = json.dumps({**json.loads(make_summary().model_dump_json()), "schema_version": 4})
    path.write_text(record)
    write_log(path, [make_record(1)])
    assert path.read_text() == record + "\n" + make_record(1).model_dump_json() + "\n"
    assert not [w for w in recwarn if "cut short" in str(w.message)]


def test_keeps_a_last_line_without_a_newline_nesting_too_deeply_to_parse(tmp_path, recwarn):
    path = tmp_path / "log.jsonl"
    first = make_record(0).model_dump_json() + "\n"
    path.write_text(first + "[" * 100_000)
    write_log(path, [make_record(1)])
    assert (
        path.read_text() == first + "[" * 100_000 + "\n" + make_record(1).model_dump_json() + "\n"
    )
    assert not [w for w in recwarn if "cut short" in str(w.message)]


def test_a_write_that_fails_part_way_is_cut_off_so_later_records_stay_readable(
    tmp_path, monkeypatch
):
    path = tmp_path / "log.jsonl"
    sink = JsonlSink(path)
    sink.write(make_record(0))
    real_write, calls = os.write, []

    def disk_fills_up(fd, data):  # a short write, then no space left
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:40]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", disk_fills_up)
    with pytest.raises(LogWriteError) as raised:
        sink.write(make_record(1))
    assert raised.value.strerror == f"{path}: a write failed: No space left on device"
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.setattr(os, "write", real_write)
    sink.write(make_record(2))
    sink.close()
    assert len(calls) == 2
    result = read_log(path)
    assert ([record.step for record in result.records], result.num_skipped) == ([0, 2], 0)


def test_a_flush_that_fails_at_close_is_a_log_write_error_and_the_file_is_closed(
    tmp_path, monkeypatch
):
    sink = JsonlSink(tmp_path / "log.jsonl")
    sink.write(make_record(0))
    fd, closed = sink._fd, []
    real_close = os.close

    def fsync_fails(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync_fails)
    monkeypatch.setattr(os, "close", lambda fd: (closed.append(fd), real_close(fd)))
    with pytest.raises(LogWriteError, match="a write failed: Input/output error"):
        sink.close()
    assert closed == [fd]


def test_a_write_interrupted_after_part_of_its_line_is_cut_off(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    sink = JsonlSink(path)
    sink.write(make_record(0))
    real_write = os.write

    # part of the line reaches the file, then Ctrl-C lands before write returns
    def interrupted(fd, data):
        real_write(fd, bytes(data[:40]))
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sink.write(make_record(1))
    monkeypatch.setattr(os, "write", real_write)
    sink.write(make_summary())
    sink.close()
    assert [record.record_type for record in read_log(path).records] == [
        "divergence",
        "run_summary",
    ]


def test_non_finite_floats_read_back_as_themselves(tmp_path):
    path = tmp_path / "log.jsonl"
    write_log(
        path,
        [
            make_record(0).model_copy(
                update={"replay": {"x": float("inf"), "y": [float("-inf")], "z": float("nan")}}
            )
        ],
    )
    replay = read_log(path).records[0].replay
    assert (replay["x"], replay["y"]) == (float("inf"), [float("-inf")]) and math.isnan(replay["z"])


def test_merges_several_logs_in_order(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_log(first, [make_record(0)])
    write_log(second, [make_record(1), make_summary()])
    with open(second, "a") as file:
        file.write("{")
    result = read_logs([first, second])
    assert [type(record).__name__ for record in result.records] == [
        "DivergenceRecord",
        "DivergenceRecord",
        "RunSummary",
    ]
    assert (result.num_read, result.num_skipped, len(result.warnings)) == (3, 1, 1)


def test_write_atomic_replaces_the_file_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "out" / "report.md"
    write_atomic(path, "old")
    write_atomic(path, "new ✓")
    assert path.read_text(encoding="utf-8") == "new ✓"
    assert [p.name for p in path.parent.iterdir()] == ["report.md"]


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "report.md"
    write_atomic(path, "old")

    def broken_replace(source, target):
        raise OSError("device full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="device full"):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


def test_write_atomic_keeps_an_existing_files_permissions(tmp_path):
    path = tmp_path / "report.md"
    write_atomic(path, "old")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    path.chmod(0o600)
    write_atomic(path, "new")
    assert (path.read_text(), stat.S_IMODE(path.stat().st_mode)) == ("new", 0o600)


def test_write_atomic_replaces_a_symlinks_target_and_keeps_the_link(tmp_path):
    target, link = tmp_path / "real.md", tmp_path / "link.md"
    target.write_text("old")
    link.symlink_to(target)
    write_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.md", "real.md"]


def test_write_atomic_writes_through_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    write_atomic(fifo, "through the pipe")
    reader.join(timeout=10)
    assert received == ["through the pipe"]
    # still the FIFO, not a regular file put in its place
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]
    write_atomic("/dev/null", "discarded")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize(
    "content",
    [
        '{"name": "smoke", "requests": []}\n',
        "# notes\nno newline at the end",
        "[" * 100_000 + "\n",
        "one line and no newline",
        "\n\nnot a record\n",
    ],
    ids=["workload", "text", "deep-json", "one-line-no-newline", "after-blank-lines"],
)
def test_a_file_that_is_no_log_is_refused_and_left_as_it_was(tmp_path, content):
    path = tmp_path / "workload.json"
    path.write_text(content)
    sink = JsonlSink(path)
    with pytest.raises(
        RecordError,
        match=r"workload.json: not a divergence log \(its first line is no record\), so "
        r"nothing is appended to it; name a new file or an existing log",
    ):
        sink.write(make_record(0))
    assert path.read_text() == content
    with pytest.raises(RecordError):
        sink.open()
    assert path.read_text() == content


def test_a_log_cut_short_in_its_first_write_is_still_a_log(tmp_path, recwarn):
    path = tmp_path / "log.jsonl"
    path.write_text(make_record(0).model_dump_json()[:40])
    write_log(path, [make_record(1)])
    assert path.read_text() == make_record(1).model_dump_json() + "\n"
    assert [w for w in recwarn if "cut short" in str(w.message)]


def test_a_file_of_blank_lines_is_an_empty_log_and_appended_to(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("\n\n")
    write_log(path, [make_record(1)])
    assert [type(record).__name__ for record in read_log(path).records] == ["DivergenceRecord"]


def test_write_atomic_writes_through_dev_stdout_when_it_is_a_pipe():
    code = "from compare.sink import write_atomic; write_atomic('/dev/stdout', 'through the pipe')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "through the pipe", "")
