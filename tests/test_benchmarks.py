"""The benchmarks under ``scripts/`` run end to end at toy sizes and write the figures they promise.

No timing is asserted (tests never time): each script is run as a child process with
tiny sizes and its JSON is checked for shape and for what must hold whatever the
machine does. Both scripts exit non-zero when the paths disagree (``bench_kv_ops``:
different counters) or compare mode logs a divergence (``bench_compare``).
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from compare import RunSummary

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run_benchmark(name: str, *args: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_bench_kv_ops_times_both_paths_on_every_mix_and_size(tmp_path):
    out = tmp_path / "kv_ops.json"
    run_benchmark(
        "bench_kv_ops.py",
        "--sizes",
        "8,16",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--repeats",
        "2",
        "--json-out",
        str(out),
    )
    figures = json.loads(out.read_text())
    assert [(row["mix"], row["num_requests"]) for row in figures["rows"]] == [
        ("decode", 8),
        ("decode", 16),
        ("pressure", 8),
        ("pressure", 16),
    ]
    for row in figures["rows"]:
        assert len(row["ratios"]) == 2 and row["ratio_plan_legacy"] > 0
        assert set(row["us_per_step_by_op"]["plan"]) == {
            "poll",
            "release",
            "evict",
            "migrate",
            "alloc",
        }
        assert set(row["window_stats"]) == {
            "evictions",
            "loads",
            "recompute_preemptions",
            "tokens_generated",
        }


def test_bench_kv_ops_in_several_processes_reports_the_median_of_their_ratios(tmp_path):
    out = tmp_path / "kv_ops.json"
    run_benchmark(
        "bench_kv_ops.py",
        "--sizes",
        "8",
        "--mixes",
        "pressure",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--processes",
        "3",
        "--json-out",
        str(out),
    )
    figures = json.loads(out.read_text())
    assert figures["args"]["processes"] == 3
    [row] = figures["rows"]
    # every repeat of every process
    assert len(row["process_ratios"]) == 3 and len(row["ratios"]) == 6
    assert row["ratio_plan_legacy"] == sorted(row["process_ratios"])[1]
    assert all(len(row["us_per_step_samples"][path]) == 6 for path in ("legacy", "plan"))


def bench_kv_ops_module(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import bench_kv_ops

    return bench_kv_ops


def test_bench_kv_ops_hands_every_measuring_option_to_its_processes(monkeypatch):
    module = bench_kv_ops_module(monkeypatch)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_kv_ops.py",
            "--sizes",
            "8,16",
            "--mixes",
            "pressure",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--repeats",
            "2",
            "--clock",
            "wall",
            "--seed",
            "3",
            "--processes",
            "4",
        ],
    )
    args = module.parse_args()
    monkeypatch.setattr(sys, "argv", ["bench_kv_ops.py", *module.child_argv(args)])
    assert vars(module.parse_args()) == {**vars(args), "processes": 1}


def test_bench_kv_ops_names_a_process_that_failed(monkeypatch):
    module = bench_kv_ops_module(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["bench_kv_ops.py", "--sizes", "8", "--processes", "3"])
    args = module.parse_args()
    failed = subprocess.CompletedProcess([], 3, "", "Traceback ...\nMemoryError: out of memory\n")
    monkeypatch.setattr(module.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(
        SystemExit, match=r"^process 1 of 3 failed \(exit 3\): MemoryError: out of memory$"
    ):
        module.measure_in_processes(args, module.Console(quiet=True))


def test_bench_kv_ops_stops_a_process_that_runs_past_its_timeout(monkeypatch):
    module = bench_kv_ops_module(monkeypatch)
    monkeypatch.setattr(
        sys,
        "argv",
        ["bench_kv_ops.py", "--sizes", "8", "--processes", "3", "--process-timeout", "2.5"],
    )
    args = module.parse_args()
    given = {}

    def hangs(*call, **options):
        given.update(options)
        raise subprocess.TimeoutExpired(call[0], options["timeout"])

    monkeypatch.setattr(module.subprocess, "run", hangs)
    with pytest.raises(
        SystemExit, match=r"^process 1 of 3 ran past --process-timeout 2\.5 s and was stopped$"
    ):
        module.measure_in_processes(args, module.Console(quiet=True))
    assert given["timeout"] == 2.5


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_bench_kv_ops_refuses_a_process_timeout_that_is_not_positive(value):
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "bench_kv_ops.py"),
            *TOY_SIZES["bench_kv_ops.py"],
            "--process-timeout",
            value,
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        f"--process-timeout must be a number of seconds > 0, got {float(value):g}"
    ), done.stderr


@pytest.mark.parametrize("flag", ["--processes", "--repeats", "--steps"])
def test_bench_kv_ops_refuses_no_processes_repeats_or_steps(flag):
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "bench_kv_ops.py"),
            *TOY_SIZES["bench_kv_ops.py"],
            flag,
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (
        2,
        "bench_kv_ops.py: error: --steps, --repeats and --processes must be >= 1, --warmup >= 0",
    ), done.stderr


def test_bench_compare_reports_the_harness_both_ways_and_every_goal(tmp_path):
    out, md = tmp_path / "compare.json", tmp_path / "compare.md"
    run_benchmark(
        "bench_compare.py",
        "--sizes",
        "8,16",
        "--steps",
        "6",
        "--repeats",
        "1",
        "--no-e2e",
        "--json-out",
        str(out),
        "--md-out",
        str(md),
    )
    figures = json.loads(out.read_text())
    assert [row["num_requests"] for row in figures["sizes"]] == [8, 16]
    assert set(figures["goals"]) == {
        "bookkeeping_ratio",
        "quiet_harness_growth",
        "quiet_direct_harness_growth",
        "quiet_floor_growth",
    }
    for row in figures["per_step"]:
        for variant in (
            "plan",
            "legacy",
            "compare",
            "rollout",
            "compare-attributed",
            "rollout-attributed",
            "floor",
        ):
            assert len(row[f"{variant}_s"]) == 6
        # in-run: time outside the paths' calls
        for direct in ("compare-attributed", "rollout-attributed", "floor"):
            assert all(seconds >= 0 for seconds in row[f"{direct}_s"])
    assert "harness in-run" in md.read_text() and "floor in-run" in md.read_text()


TOY_SIZES = {  # so that a script which failed to refuse the path would still end in seconds
    "bench_kv_ops.py": ("--sizes", "8", "--steps", "1", "--warmup", "0", "--repeats", "1"),
    "bench_compare.py": ("--sizes", "8", "--steps", "2", "--repeats", "1", "--no-e2e"),
    "bench_migration.py": ("--pages", "4", "--page-kib", "4", "--repeats", "1"),
    "bench_throughput.py": (
        "--geometry",
        "64x1",
        "--vocab-size",
        "256",
        "--static-requests",
        "3",
        "--static-new-tokens",
        "3",
        "--mixed-requests",
        "5",
        "--mixed-new-tokens",
        "1,6",
        "--max-num-seqs",
        "2",
        "--prompt-tokens",
        "2,9",
        "--repeats",
        "1",
    ),
    "scale_check.py": (
        "--modes",
        "plan",
        "--requests",
        "8",
        "--gpu-pages",
        "2000",
        "--steps",
        "2",
        "--rss-from-step",
        "1",
    ),
}


@pytest.mark.parametrize(
    "name, flag",
    [
        ("bench_kv_ops.py", "--json-out"),
        ("bench_compare.py", "--json-out"),
        ("bench_compare.py", "--md-out"),
        ("bench_migration.py", "--json-out"),
        ("bench_throughput.py", "--json-out"),
        ("scale_check.py", "--json-out"),
    ],
)
def test_a_benchmark_refuses_an_output_file_it_cannot_write_before_it_runs(tmp_path, name, flag):
    missing = tmp_path / "missing" / "figures.json"
    for out, error in (
        (missing, f"argument {flag}: cannot write {missing}: no directory {missing.parent}"),
        (tmp_path, f"argument {flag}: '{tmp_path}' is a directory, not a file to write"),
    ):
        done = subprocess.run(
            [sys.executable, str(SCRIPTS / name), *TOY_SIZES[name], flag, str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (
            2,
            f"{name}: error: {error}",
        ), done.stderr


def test_bench_throughput_runs_both_systems_on_both_mixes_and_gets_hf_tokens(tmp_path):
    out = tmp_path / "throughput.json"
    run_benchmark("bench_throughput.py", *TOY_SIZES["bench_throughput.py"], "--json-out", str(out))
    figures = json.loads(out.read_text())
    assert [(row["geometry"], row["mix"]) for row in figures["rows"]] == [
        ("64x1", "static"),
        ("64x1", "mixed"),
    ]
    static, mixed = figures["rows"]
    assert static["num_tokens"] == 3 * 3 and 5 <= mixed["num_tokens"] <= 5 * 6
    for row in figures["rows"]:
        assert row["num_requests_differing"] == row["num_requests_near_tie"] == 0
        assert len(row["hf_wall_s"]) == len(row["batchgen_cpu_s"]) == 1
        assert row["ratio_wall"] > 0 and row["ratio_cpu"] > 0


@pytest.mark.parametrize("flag, value", [("--pages", "0"), ("--pages", "-3"), ("--repeats", "0")])
def test_bench_migration_refuses_an_empty_batch_or_no_repeats(flag, value):
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_migration.py"), "--page-kib", "4", flag, value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (
        2,
        "bench_migration.py: error: --pages and --repeats must be >= 1",
    ), done.stderr


def test_bench_migration_refuses_pools_larger_than_the_memory_available():
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "bench_migration.py"),
            "--pages",
            "100000000",
            "--page-kib",
            "4",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert re.fullmatch(
        r"bench_migration\.py: error: --pages 100000000 x --page-kib 4 needs 1525\.9 GiB of host "
        r"memory for its pools; [\d.]+ GiB is available",
        done.stderr.strip().splitlines()[-1],
    )


def test_bench_compare_with_one_size_says_the_fit_needs_two(tmp_path):
    out, md = tmp_path / "compare.json", tmp_path / "compare.md"
    run_benchmark(
        "bench_compare.py",
        *TOY_SIZES["bench_compare.py"],
        "--json-out",
        str(out),
        "--md-out",
        str(md),
    )
    assert json.loads(out.read_text())["harness_fit"] is None
    assert "least-squares fit over all steps: needs two or more --sizes" in md.read_text()


def test_bench_compare_refuses_profile_with_output_files_it_would_leave_unwritten(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "bench_compare.py"),
            *TOY_SIZES["bench_compare.py"],
            "--profile",
            "8",
            "--json-out",
            str(tmp_path / "figures.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (
        2,
        (
            "bench_compare.py: error: --profile prints a profile and measures nothing else;"
            " --json-out and --md-out would stay unwritten: leave them out"
        ),
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("count", ["0", "-2"])
def test_bench_compare_refuses_a_profile_of_no_requests_instead_of_running_the_benchmark(count):
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "bench_compare.py"),
            *TOY_SIZES["bench_compare.py"],
            "--profile",
            count,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (
        2,
        f"bench_compare.py: error: --profile takes a request count >= 1, got {count}",
    ), done.stdout + done.stderr


@pytest.mark.parametrize(
    "flag, value, error",
    [
        (
            "--requests",
            "1",
            "--requests must be >= 2 (an anchor and a crowd), --gpu-pages and --torch-threads >= 1",
        ),
        ("--max-rss-ratio", "0", "--max-rss-ratio must be a positive number, got 0.0"),
        ("--max-rss-ratio", "nan", "--max-rss-ratio must be a positive number, got nan"),
        ("--profile", "-3", "--profile takes a function count >= 0 (0: no profile), got -3"),
        (
            "--gpu-pages",
            "10",
            (
                "--requests 8 with --gpu-pages 10: 10 GPU pages cannot hold the crowd of 7 requests"
                " (17 pages); give more pages or fewer requests"
            ),
        ),
        (
            "--steps",
            "1",
            "--steps must be >= 2 (the resident set is compared between two steps), got 1",
        ),
    ],
)
def test_scale_check_refuses_a_size_or_bound_no_run_can_meet(flag, value, error):
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "scale_check.py"),
            *TOY_SIZES["scale_check.py"],
            flag,
            value,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (
        2,
        f"scale_check.py: error: {error}",
    ), done.stdout[-2000:] + done.stderr[-2000:]


def test_ci_divergence_gate_renders_no_earlier_log_when_validate_refuses_its_flags(tmp_path):
    earlier = RunSummary(
        run_id="earlier-1",
        workload="L2-2048",
        seed=0,
        authoritative="plan",
        shadow="legacy",
        steps_compared={"alloc": 3},
        divergences={},
        harness_errors=0,
        compare_seconds=0.1,
        authoritative_seconds=1.0,
    )
    # a clean log report would render
    (tmp_path / "divergences.jsonl").write_text(earlier.model_dump_json() + "\n")
    done = subprocess.run(
        [str(SCRIPTS / "ci_divergence_gate.sh"), "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable, "REPORTS_DIR": str(tmp_path)},
    )
    assert done.returncode == 2, done.stderr
    assert "ci_divergence_gate: validate refused its input; nothing rendered" in done.stderr
    assert done.stdout == "" and not (tmp_path / "divergences.xml").exists()


def test_ci_divergence_gate_takes_relative_paths_from_the_directory_it_is_run_in(tmp_path):
    (tmp_path / "bin").mkdir()
    # PYTHON, relative
    (tmp_path / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (tmp_path / "bin" / "python").chmod(0o755)
    done = subprocess.run(
        [str(SCRIPTS / "ci_divergence_gate.sh"), "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": "bin/python", "REPORTS_DIR": "out"},
    )
    # bin/python imported batchgen: validate ran, and refused the flag
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == f"ci_divergence_gate: exit 2; reports in {tmp_path}/out/"


@pytest.mark.parametrize(
    "flags",
    [
        ["--reports-dir", "elsewhere"],
        ["--seed", "3", "--reports-dir=elsewhere"],
        ["--rep", "elsewhere"],
    ],
)
def test_ci_divergence_gate_refuses_reports_dir_which_would_split_what_it_runs_from_what_it_renders(
    tmp_path, flags
):
    done = subprocess.run(
        [str(SCRIPTS / "ci_divergence_gate.sh"), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": sys.executable, "REPORTS_DIR": str(tmp_path / "reports")},
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert (
        done.stderr
        == "ci_divergence_gate: set REPORTS_DIR instead of passing --reports-dir (the gate renders "
        "the log it finds there)\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("interpreter", ["/nonexistent/python", "bare"])
def test_ci_divergence_gate_names_an_interpreter_without_batchgen(tmp_path, interpreter):
    """``bare``: a Python that can import the checkout's empty ``batchgen`` package but not its
    dependencies."""
    if interpreter == "bare":
        interpreter = str(tmp_path / "bare-python")
        # no site-packages
        Path(interpreter).write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
        Path(interpreter).chmod(0o755)
    reports = tmp_path / "r"
    done = subprocess.run(
        [str(SCRIPTS / "ci_divergence_gate.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": interpreter, "REPORTS_DIR": str(reports)},
    )
    assert (done.returncode, done.stderr) == (
        2,
        (
            f"ci_divergence_gate: {interpreter} cannot import batchgen; set "
            "PYTHON to the interpreter it is installed in\n"
        ),
    )
    assert not reports.exists()


def test_ci_divergence_gate_shows_its_help_wherever_the_flag_is():
    done = subprocess.run(
        [str(SCRIPTS / "ci_divergence_gate.sh"), "--seed", "3", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": "/nonexistent/python"},
    )
    assert done.returncode == 0 and done.stdout.startswith(
        "CI divergence gate: the back-to-back validation"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--scale", "abc"],
            (
                "batchgen: error: argument --scale: must be a number in (0, 1000], got 'abc' (see"
                " 'batchgen validate --help')"
            ),
        ),
        (
            ["--seed", "-1"],
            (
                "batchgen: error: argument --seed: must be an integer >= 0, got '-1' (see 'batchgen"
                " validate --help')"
            ),
        ),
        (
            ["--reports-dir", "{file}/h20"],
            "h20_validate: --reports-dir {file}/h20: cannot create the directory",
        ),
    ],
    ids=["scale", "seed", "reports-dir-under-a-file"],
)
def test_h20_validate_refuses_bad_flags_before_anything_runs_or_is_written(
    tmp_path, flags, message
):
    (tmp_path / "file").write_text("")
    reports = tmp_path / "reports"
    flags = [flag.format(file=tmp_path / "file") for flag in flags]
    if "--reports-dir" not in flags:
        flags += ["--reports-dir", str(reports)]
    done = subprocess.run(
        [str(SCRIPTS / "h20_validate.sh"), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        2,
        "",
        message.format(file=tmp_path / "file") + "\n",
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]


def test_h20_validate_refuses_a_bad_kv_path_before_anything_runs():
    done = subprocess.run(
        [str(SCRIPTS / "h20_validate.sh"), "--kv-path", "plans"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert (done.returncode, done.stderr) == (
        2,
        "h20_validate: --kv-path takes plan or legacy, not 'plans' (see --help)\n",
    )


def output_path_module():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import output_path
    finally:
        sys.path.remove(str(SCRIPTS))
    return output_path


def test_an_output_path_that_cannot_be_created_is_refused_when_parsed_and_nothing_is_left_behind(
    tmp_path,
):
    module = output_path_module()
    with pytest.raises(
        argparse.ArgumentTypeError, match=r"^cannot write /proc/figures.json: No such file or "
    ):
        module.output_path("/proc/figures.json")  # os.access says yes to root here
    assert module.output_path(str(tmp_path / "figures.json")) == tmp_path / "figures.json"
    assert list(tmp_path.iterdir()) == []  # the file made to try it is gone
    # dangling: the write will create its target
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    assert module.output_path(str(tmp_path / "link.json")) == tmp_path / "link.json"
    assert [path.name for path in tmp_path.iterdir()] == ["link.json"] and (
        tmp_path / "link.json"
    ).is_symlink()


def test_a_write_that_fails_at_the_end_is_one_error_line_and_exit_1(capsys, monkeypatch):
    module = output_path_module()
    monkeypatch.setattr(sys, "argv", ["bench_kv_ops.py"])
    with pytest.raises(SystemExit) as ended:
        module.write_output(Path("/dev/full"), "{}")
    assert ended.value.code == 1
    assert (
        capsys.readouterr().err
        == "bench_kv_ops.py: error: cannot write /dev/full: No space left on device (the "
        "figures are in the tables above)\n"
    )
