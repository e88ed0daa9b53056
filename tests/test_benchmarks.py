"""The benchmarks of ``scripts/bench.py`` run end to end at toy sizes and print the goals they
promise; the shell scripts beside it refuse what they cannot run.

No timing is asserted (tests never time): each subcommand is run as a child process with tiny sizes
(its refusals of bad flags, in this process) and its JSON and its output are checked for shape,
and for what must hold whatever the machine does. ``kv-ops`` exits non-zero when the paths
disagree (different counters), ``compare`` when compare mode logs a divergence.
"""

import argparse
import gc
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compare import RunSummary

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TOY_SIZES = {  # so that a benchmark which failed to refuse the path would still end in seconds
    "kv-ops": ("--sizes", "8", "--steps", "1", "--warmup", "0", "--repeats", "1"),
    "compare": ("--sizes", "8", "--steps", "2", "--repeats", "1", "--no-e2e"),
    "migration": ("--pages", "4", "--page-kib", "4", "--repeats", "1"),
    "kv-verify": ("--workload", "smoke", "--repeats", "1"),
    "decode-attention": ("--cases", "3:1-40", "--layers", "2", "--repeats", "1"),
    "throughput": (
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
    "scale": (
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


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """``python scripts/bench.py NAME ARGS`` in a child process."""
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "bench.py"), name, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_benchmark(name: str, *args: str) -> str:
    """Run a subcommand that must succeed; its standard output."""
    done = run_script(name, *args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def script_module(monkeypatch, name: str):
    """``scripts/bench.py`` (``bench``) or a module of ``scripts/benchmarks/``."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module(name if name == "bench" else f"benchmarks.{name}")


def refusal(monkeypatch, capsys, name: str, *args: str) -> tuple[int, str]:
    """Run subcommand ``name`` with ``args`` in this process (``bench.main``), where it must exit:
    its exit code and the last line it wrote to stderr. (A child process per case would spend its
    time importing torch; a benchmark that failed to refuse runs its toy sizes and fails the
    test.)"""
    bench = script_module(monkeypatch, "bench")
    with pytest.raises(SystemExit) as exited:
        bench.main([name, *args])
    return exited.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def test_the_entry_point_lists_every_subcommand_and_refuses_an_unknown_one(monkeypatch, capsys):
    bench = script_module(monkeypatch, "bench")
    assert bench.main(["--help"]) == 0
    shown = capsys.readouterr().out
    for name in ("kv-ops", "compare", "kv-verify", "scale", "migration", "decode-attention"):
        assert f"\n  {name} " in shown
    for name in ("throughput", "vllm", "generate", "replicas", "sweep"):
        assert f"\n  {name} " in shown
    assert bench.main(["kv_ops"]) == 2
    assert capsys.readouterr().err.startswith(
        "bench.py: error: no subcommand 'kv_ops' (choose from"
    )


def test_bench_kv_ops_times_both_paths_on_every_mix_and_size_and_prints_the_goal(tmp_path):
    out = tmp_path / "kv_ops.json"
    toy = ("--sizes", "8,16", "--steps", "4", "--warmup", "2", "--repeats", "2")
    stdout = run_benchmark("kv-ops", *toy, "--json-out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(row["mix"], row["num_requests"]) for row in rows] == [
        ("decode", 8),
        ("decode", 16),
        ("pressure", 8),
        ("pressure", 16),
    ]
    for row in rows:
        assert len(row["ratios"]) == 2 and row["ratio_plan_legacy"] > 0
        assert row["goal"] == 1.1 and row["met"] == (row["ratio_plan_legacy"] <= 1.1)
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
    assert "goal plan/legacy <= 1.1x: " in stdout


def test_bench_kv_ops_holds_every_size_to_one_goal(monkeypatch):
    module = script_module(monkeypatch, "kv_ops")

    def runs(legacy_ns: int, plan_ns: int) -> dict:
        return {
            "legacy": [module.Run(dict.fromkeys(module.KV_OPS, legacy_ns))],
            "plan": [module.Run(dict.fromkeys(module.KV_OPS, plan_ns))],
        }

    ratios = {64: 1100, 512: 1200, 4096: 700}  # plan ns per op against legacy's 1000
    rows = [module.summarise("decode", n, runs(1000, plan), 1) for n, plan in ratios.items()]
    assert [(row["ratio_plan_legacy"], row["goal"], row["met"]) for row in rows] == [
        (1.1, 1.1, True),
        (1.2, 1.1, False),
        (0.7, 1.1, True),
    ]


@pytest.mark.parametrize("flag", ["--repeats", "--steps"])
def test_bench_kv_ops_refuses_no_repeats_or_steps(monkeypatch, capsys, flag):
    refused = refusal(monkeypatch, capsys, "kv-ops", *TOY_SIZES["kv-ops"], flag, "0")
    assert refused == (
        2,
        "bench.py kv-ops: error: --steps and --repeats must be >= 1, --warmup >= 0",
    )


def test_bench_compare_measures_every_variant_and_prints_every_goal_it_can_judge(tmp_path):
    out = tmp_path / "compare.json"
    toy = ("--sizes", "8,16", "--steps", "6", "--repeats", "1", "--no-e2e")
    stdout = run_benchmark("compare", *toy, "--json-out", str(out))
    figures = json.loads(out.read_text())
    assert [row["num_requests"] for row in figures["sizes"]] == [8, 16]
    assert set(figures["goals"]) == {"coverage", "quiet_harness_growth"}
    assert figures["goals"]["coverage"]["goal"] == 1.05
    for row in figures["per_step"]:
        for variant in ("plan", "legacy", "compare", "coverage_off"):
            assert len(row[f"{variant}_s"]) == 6
        assert row["touched"][0] == row["num_requests"]  # step 0 admits every request
    for size in figures["sizes"]:
        assert size["coverage_ratio"] == pytest.approx(
            size["compare_us_per_step"] / size["coverage_off_us_per_step"]
        )
    assert "compare / coverage off" in stdout and "coverage classification" in stdout


def test_bench_compare_with_one_size_leaves_out_the_growth_goal(tmp_path):
    out = tmp_path / "compare.json"
    run_benchmark("compare", *TOY_SIZES["compare"], "--json-out", str(out))
    assert set(json.loads(out.read_text())["goals"]) == {"coverage"}


def test_bench_compare_collector_off_pauses_the_collector_for_the_timed_steps_only(
    monkeypatch, tmp_path
):
    module = script_module(monkeypatch, "compare_bookkeeping")
    enabled_at_steps = []
    step = module.Worker.step

    def probed(self):
        enabled_at_steps.append(gc.isenabled())
        step(self)

    monkeypatch.setattr(module.Worker, "step", probed)
    workload = module.concurrent_workload(8, 3, 0)
    module.timed_steps(workload, "compare", 3, tmp_path / "log.jsonl", collector=False)
    assert enabled_at_steps == [False, False, False] and gc.isenabled()
    module.timed_steps(workload, "compare", 3, tmp_path / "log.jsonl")
    assert enabled_at_steps[3:] == [True, True, True]


def test_bench_compare_coverage_off_classifies_nothing_and_decides_the_same(monkeypatch, tmp_path):
    module = script_module(monkeypatch, "compare_bookkeeping")
    workload = module.concurrent_workload(16, 12, 0)
    summaries = {}
    for variant in ("compare", "coverage_off"):
        worker = module.new_worker(workload, variant, tmp_path / "log.jsonl")
        for _ in range(12):
            worker.step()
        summaries[variant] = worker.kv_compare.end_run()
    assert summaries["compare"].coverage and not summaries["coverage_off"].coverage
    assert summaries["compare"].steps_compared == summaries["coverage_off"].steps_compared
    assert not any(summary.divergences for summary in summaries.values())


def test_bench_compare_judges_end_to_end_on_cpu_time_against_its_goal(monkeypatch):
    module = script_module(monkeypatch, "compare_report")
    sizes = [{"num_requests": 8, "coverage_ratio": 1.01}]
    e2e = {"ratio": 1.07, "basis": "process CPU time"}
    assert module.verdicts(sizes, [], e2e) == {
        "end_to_end": {
            "value": 1.07,
            "at": "L2-4096, process CPU time",
            "goal": 1.05,
            "met": False,
        },
        "coverage": {"value": 1.01, "at": "N = 8", "goal": 1.05, "met": True},
    }


def test_bench_compare_gives_no_growth_verdict_when_a_quiet_harness_is_not_above_zero(
    monkeypatch,
):
    module = script_module(monkeypatch, "compare_report")
    sizes = [{"num_requests": n, "coverage_ratio": 1.0} for n in (64, 4096)]
    touched = [
        {"num_requests": 64, "touched": "0-4", "harness_us": 110.0},
        {"num_requests": 4096, "touched": "0-4", "harness_us": -454.0},
        {"num_requests": 4096, "touched": "5-32", "harness_us": 300.0},
    ]
    assert module.verdicts(sizes, touched, None)["quiet_harness_growth"] == {
        "value": None,
        "at": "N = 4096 vs 64: a harness <= 0, within the noise",
        "goal": 2.0,
        "met": None,
    }
    touched[1]["harness_us"] = 330.0
    assert module.verdicts(sizes, touched, None)["quiet_harness_growth"]["value"] == 3.0


def test_bench_compare_refuses_profile_with_an_output_file_it_would_leave_unwritten(
    tmp_path, monkeypatch, capsys
):
    toy = TOY_SIZES["compare"]
    figures = str(tmp_path / "figures.json")
    refused = refusal(monkeypatch, capsys, "compare", *toy, "--profile", "8", "--json-out", figures)
    assert refused == (
        2,
        "bench.py compare: error: --profile prints a profile and measures nothing else: leave out"
        " --json-out",
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("count", ["0", "-2"])
def test_bench_compare_refuses_a_profile_of_no_requests_instead_of_running_the_benchmark(
    monkeypatch, capsys, count
):
    toy = TOY_SIZES["compare"]
    assert refusal(monkeypatch, capsys, "compare", *toy, "--profile", count) == (
        2,
        f"bench.py compare: error: --profile takes a request count >= 1, got {count}",
    )


@pytest.mark.parametrize(
    "name, flag",
    [
        ("kv-ops", "--json-out"),
        ("compare", "--json-out"),
        ("migration", "--json-out"),
        ("decode-attention", "--json-out"),
        ("throughput", "--json-out"),
        ("scale", "--json-out"),
    ],
)
def test_a_benchmark_refuses_an_output_file_it_cannot_write_before_it_runs(
    tmp_path, monkeypatch, capsys, name, flag
):
    missing = tmp_path / "missing" / "figures.json"
    for out, error in (
        (missing, f"argument {flag}: cannot write {missing}: no directory {missing.parent}"),
        (tmp_path, f"argument {flag}: '{tmp_path}' is a directory, not a file to write"),
    ):
        refused = refusal(monkeypatch, capsys, name, *TOY_SIZES[name], flag, str(out))
        assert refused == (2, f"bench.py {name}: error: {error}")


def test_bench_throughput_runs_both_systems_on_both_mixes_and_gets_hf_tokens(tmp_path):
    out = tmp_path / "throughput.json"
    run_benchmark("throughput", *TOY_SIZES["throughput"], "--json-out", str(out))
    figures = json.loads(out.read_text())
    assert [(row["geometry"], row["mix"], row["schedule_policy"]) for row in figures["rows"]] == [
        ("64x1", "static", "fcfs"),
        ("64x1", "mixed", "fcfs"),
        ("64x1", "mixed", "lof"),
    ]
    static, mixed, mixed_lof = figures["rows"]
    assert static["num_tokens"] == 3 * 3 and 5 <= mixed["num_tokens"] <= 5 * 6
    assert mixed_lof["hf_wall_s"] == mixed["hf_wall_s"]  # one HF run, both admission orders
    for row in figures["rows"]:
        assert row["num_requests_differing"] == row["num_requests_near_tie"] == 0
        assert len(row["hf_wall_s"]) == len(row["batchgen_cpu_s"]) == 1
        assert row["ratio_wall"] > 0 and row["ratio_cpu"] > 0


def test_bench_decode_attention_times_both_variants_and_cuts_unequal_rows(tmp_path):
    out = tmp_path / "attention.json"
    toy = ("--cases", "2:1-3,6:2-400", "--layers", "2", "--page-size", "2", "--repeats", "1")
    run_benchmark("decode-attention", *toy, "--json-out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(row["rows"], row["tokens"]) for row in rows] == [(2, "1-3"), (6, "2-400")]
    # at most 2 pages against 2: one batch; up to 201 pages against as few as 2: several
    assert rows[0]["batches"] == 1 and rows[1]["batches"] > 1
    for row in rows:
        assert set(row["ms_per_step"]) == {"in place", "one batch", "grouped"}
        assert row["ratio"] > 0 and row["in_place_ratio"] > 0


@pytest.mark.parametrize("case", ["3", "3:5", "0:1-4", "3:4-1", "a:1-2"])
def test_bench_decode_attention_refuses_a_malformed_case(monkeypatch, capsys, case):
    assert refusal(monkeypatch, capsys, "decode-attention", "--cases", case) == (
        2,
        f"bench.py decode-attention: error: --cases takes ROWS:MIN-MAX with 1 <= MIN <= MAX,"
        f" got {case!r}",
    )


@pytest.mark.parametrize("flag, value", [("--pages", "0"), ("--pages", "-3"), ("--repeats", "0")])
def test_bench_migration_refuses_an_empty_batch_or_no_repeats(monkeypatch, capsys, flag, value):
    assert refusal(monkeypatch, capsys, "migration", "--page-kib", "4", flag, value) == (
        2,
        "bench.py migration: error: --pages and --repeats must be >= 1",
    )


def test_bench_migration_refuses_pools_larger_than_the_memory_available(monkeypatch, capsys):
    args = ("--pages", "100000000", "--page-kib", "4", "--repeats", "1")
    code, error = refusal(monkeypatch, capsys, "migration", *args)
    assert code == 2
    assert re.fullmatch(
        r"bench\.py migration: error: --pages 100000000 x --page-kib 4 needs 1525\.9 GiB of host "
        r"memory for its pools; [\d.]+ GiB is available",
        error,
    )


@pytest.mark.parametrize(
    "flag, value, error",
    [
        ("--requests", "1", "--requests must be >= 2 (an anchor and a crowd), --gpu-pages >= 1"),
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
def test_scale_check_refuses_a_size_or_bound_no_run_can_meet(
    monkeypatch, capsys, flag, value, error
):
    toy = TOY_SIZES["scale"]
    refused = refusal(monkeypatch, capsys, "scale", *toy, flag, value)
    assert refused == (2, f"bench.py scale: error: {error}")


def test_ci_divergence_gate_renders_no_earlier_log_when_validate_refuses_its_flags(tmp_path):
    earlier = RunSummary(
        binding="kv",
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


def test_an_output_path_that_cannot_be_created_is_refused_when_parsed_and_nothing_is_left_behind(
    tmp_path, monkeypatch
):
    module = script_module(monkeypatch, "output_path")
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
    module = script_module(monkeypatch, "output_path")
    monkeypatch.setattr(sys, "argv", ["scripts/bench.py", "kv-ops"])
    with pytest.raises(SystemExit) as ended:
        module.write_output(Path("/dev/full"), "{}")
    assert ended.value.code == 1
    assert (
        capsys.readouterr().err
        == "bench.py: error: cannot write /dev/full: No space left on device (the "
        "figures are in the tables above)\n"
    )


def test_bench_sweep_times_each_backend_and_the_drivers_merge(tmp_path):
    out = tmp_path / "sweep.json"
    run_benchmark(
        "sweep",
        *("--workload", "smoke", "--runs", "2", "--cpus", "1", "--backends", "processes"),
        *("--records", "4", "--repeats", "1", "--noop-tasks", "10", "--json-out", str(out)),
        *("--throughput-repeats", "1"),
    )
    figures = json.loads(out.read_text())
    (row,) = figures["throughput"]
    assert (row["backend"], row["cpus"], row["runs"], row["scaling_efficiency"]) == (
        "processes",
        1,
        2,
        1.0,
    )
    assert row["runs_per_minute"] > 0 and row["samples_runs_per_minute"] == [row["runs_per_minute"]]
    assert len(figures["load_average_1min"]) == 2
    assert [merge["kind"] for merge in figures["merge"]] == ["summary", "divergence"]
    assert [merge["records"] for merge in figures["merge"]] == [4, 4]
    assert all(merge["merge_s_per_1000"] > 0 for merge in figures["merge"])
    assert all(0 < merge["html_page_s"] for merge in figures["merge"])
    assert [loop["backend"] for loop in figures["task_loop"]] == ["processes"]


def test_bench_compare_end_to_end_reads_compare_modes_kv_share_apart_from_the_run_noise(
    monkeypatch,
):
    module = script_module(monkeypatch, "compare_end_to_end")
    runs = {
        "off": {"cpu": [2.0, 1.8, 2.2], "wall": [2.1, 1.9, 2.3], "kv": [0.05, 0.06, 0.07]},
        "on": {"cpu": [2.3, 1.9, 2.0], "wall": [2.4, 2.0, 2.1], "kv": [0.15, 0.16, 0.20]},
        "legacy": {"cpu": [2.0, 1.7, 2.1], "wall": [2.1, 1.8, 2.2], "kv": [0.03, 0.03, 0.03]},
    }
    e2e = module.summarise(runs, "cpu")
    assert e2e["ratio"] == e2e["cpu_ratio"] == pytest.approx(1.9 / 1.8)
    assert e2e["wall_ratio"] == pytest.approx(2.0 / 1.9)
    assert e2e["plan_legacy_ratio"] == pytest.approx(1.8 / 1.7)
    assert e2e["compare_kv_share"] == pytest.approx((0.16 - 0.06) / 2.0)  # medians
    assert module.summarise(runs, "cuda")["ratio"] == pytest.approx(2.0 / 1.9)


def test_bench_generate_runs_generate_and_run_on_the_same_tokens_and_prints_the_text_share():
    done = run_script("generate", "--num-lines", "6", "--geometry", "64x1")
    text = " ".join(done.stdout.split())  # rich wraps lines at the terminal's width
    verdict = re.search(r"goal text share <= 5%: (met|MISSED)", text)
    assert verdict is not None, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.returncode == (0 if verdict.group(1) == "met" else 1)
    assert "(batch composition, near-ties): 0;" in text  # six lines admitted together: one schedule
    tokens = re.findall(r"(run \(token ids\)|generate) │ [\d.]+ │ [\d.]+ │ (\d+) │", text)
    assert [name for name, _ in tokens] == ["run (token ids)", "generate"]
    assert tokens[0][1] == tokens[1][1] != "0"


def test_bench_kv_verify_runs_the_workload_with_verify_off_and_all_and_prints_the_ratio(tmp_path):
    out = tmp_path / "kv_verify.json"
    toy = TOY_SIZES["kv-verify"]
    stdout = run_benchmark("kv-verify", *toy, "--device", "cpu", "--json-out", str(out))
    figures = json.loads(out.read_text())
    assert (figures["workload"], figures["repeats"], figures["device"]) == ("smoke", 1, "cpu")
    assert (figures["tokens_equal"], figures["data_divergences"]) == (True, 0)
    assert figures["checked"]["load"] > 0 and figures["checked"]["append"] > 0
    assert len(figures["ratios"]) == 1 and figures["ratio_all_off"] == figures["ratios"][0]
    assert set(figures["median_wall_s"]) == set(figures["median_cpu_s"]) == {"off", "all"}
    assert "ratio all/off: wall " in stdout


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--repeats", "0", "--repeats must be >= 1"),
        ("--scale", "0", "--scale must be > 0, not 0.0"),
        ("--scale", "nan", "--scale must be > 0, not nan"),
    ],
)
def test_bench_kv_verify_refuses_no_repeats_or_a_scale_not_above_zero(
    monkeypatch, capsys, flag, value, message
):
    args = (*TOY_SIZES["kv-verify"], flag, value)
    assert refusal(monkeypatch, capsys, "kv-verify", *args) == (
        2,
        f"bench.py kv-verify: error: {message}",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs it")
def test_bench_kv_verify_refuses_cuda_on_a_machine_without_it(monkeypatch, capsys):
    args = (*TOY_SIZES["kv-verify"], "--device", "cuda")
    assert refusal(monkeypatch, capsys, "kv-verify", *args) == (
        2,
        "bench.py kv-verify: error: --device cuda needs CUDA, which this machine lacks",
    )
