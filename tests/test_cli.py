"""The batchgen command (exit codes, JSON, error lines) and the back-to-back validation it reports."""

import json
import re

import pytest
import torch

import batchgen.validation
from batchgen.cli import main
from batchgen.model.loader import load_model
from batchgen.validation import validate_back_to_back
from batchgen.worker.kv_backends import GpuKvPool
from batchgen.workloads import builtin_workload


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread while this module runs: on shared, busy cores torch's default
    (one thread per core) stalls in spin-waits, 5-10x slower for these tiny models."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

RUN_KEYS = {"requests", "tokens_generated", "tokens_per_s", "evictions", "loads", "recompute_preemptions",
            "peak_gpu_pages", "peak_host_pages", "leaked_gpu_pages", "leaked_host_pages", "model", "device", "seed"}


def one_json_object(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


# ---- run -------------------------------------------------------------------------------------
def test_run_json_prints_one_object_with_the_run_summary(capsys):
    assert main(["run", "--workload", "smoke", "--json"]) == 0
    summary = one_json_object(capsys.readouterr().out)
    assert RUN_KEYS <= summary.keys()
    assert (summary["workload"], summary["requests"], summary["model"], summary["device"], summary["seed"]) == (
        "smoke", 8, "tiny", "cpu", 0)
    assert summary["evictions"] > 0
    assert (summary["leaked_gpu_pages"], summary["leaked_host_pages"], summary["live_requests"]) == (0, 0, 0)


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


@pytest.mark.parametrize("command", ["run", "validate"])
def test_help_explains_every_flag_with_its_default(command, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in [("--model", "tiny"), ("--device", "cpu"), ("--dtype", "float32"), ("--seed", "0"),
                          ("--scale", "1.0"), ("--json", "off")]:
        assert re.search(f"{flag} .*?\\(default: {re.escape(default)}\\)", text), flag


# ---- bad input -------------------------------------------------------------------------------
def error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["run", "--workload", "L2-1024"],
     "batchgen: error: unknown workload 'L2-1024'; built-in workloads are smoke, L2-2048, L2-4096, "
     "or give the path of a workload JSON file"),
    (["run", "--workload", "smoke", "--model", "llama3"],
     "batchgen: error: unknown model name 'llama3'; known names: tiny, llama2-7b-geometry; or pass an HF-format "
     "model directory (config.json + *.safetensors)"),
    (["run", "--workload", "smoke", "--scale", "-1"],
     "batchgen: error: argument --scale: must be a finite number > 0, got '-1' (see 'batchgen run --help')"),
    (["run", "--workload", "smoke", "--scale", "nan"],
     "batchgen: error: argument --scale: must be a finite number > 0, got 'nan' (see 'batchgen run --help')"),
    (["validate", "--scale", "0"],
     "batchgen: error: argument --scale: must be a finite number > 0, got '0' (see 'batchgen validate --help')"),
    (["run", "--workload", "smoke", "--seed", "-3"],
     "batchgen: error: argument --seed: must be an integer >= 0, got '-3' (see 'batchgen run --help')"),
    (["run", "--workload", "smoke", "--dtype", "float64"],
     "batchgen: error: argument --dtype: invalid choice: 'float64' (choose from "),
    (["run"], "batchgen: error: the following arguments are required: --workload (see 'batchgen run --help')"),
    (["serve"], "batchgen: error: argument COMMAND: invalid choice: 'serve' (choose from "),
], ids=["unknown-workload", "unknown-model", "negative-scale", "nan-scale", "zero-scale", "negative-seed",
        "unknown-dtype", "no-workload", "unknown-command"])
def test_bad_input_exits_2_with_one_error_line(capsys, argv, message):
    assert main(argv) == 2
    assert error_line(capsys).startswith(message)  # argparse words its choice lists per Python version


def test_malformed_workload_file_exits_2(tmp_path, capsys):
    path = tmp_path / "broken.json"
    path.write_text('{"name": ')
    assert main(["run", "--workload", str(path)]) == 2
    assert error_line(capsys) == (f"batchgen: error: workload file '{path}' is not valid JSON: Expecting value "
                                  f"(line 1, column 10)")


def test_workload_request_the_model_cannot_serve_exits_2(tmp_path, capsys):
    path = tmp_path / "vocab.json"
    workload = builtin_workload("smoke", scale=0.25)
    bad = workload.model_copy(update={"requests": [workload.requests[0].model_copy(update={"prompt_ids": [1, 600]})]})
    path.write_text(bad.model_dump_json())
    assert main(["run", "--workload", str(path)]) == 2
    assert error_line(capsys) == "batchgen: error: request 'smoke-r0': token ids [600] outside the vocabulary [0, 512)"


def test_model_directory_without_config_exits_2(tmp_path, capsys):
    assert main(["run", "--workload", "smoke", "--model", str(tmp_path)]) == 2
    assert error_line(capsys) == (f"batchgen: error: {tmp_path}/config.json: missing; a model directory needs "
                                  f"config.json next to its safetensors files")


def test_cuda_without_cuda_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["validate", "--device", "cuda"]) == 2
    assert error_line(capsys) == ("batchgen: error: --device cuda: CUDA is not available on this machine; "
                                  "allowed here: --device cpu")


# ---- validate --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture
def cheap_pair(monkeypatch):
    """Validate smoke then L2-2048 (on L2-2048's pool) instead of the two L2 traces: seconds, not minutes."""
    monkeypatch.setattr(batchgen.validation, "BACK_TO_BACK_WORKLOADS", ("smoke", "L2-2048"))


def test_validate_json_passes_at_a_scale_where_both_l2_workloads_evict(capsys):
    assert main(["validate", "--scale", "0.25", "--seed", "3", "--json"]) == 0
    report = one_json_object(capsys.readouterr().out)
    assert (report["ok"], report["failures"]) == (True, [])
    runs = {(run["workload"], run["role"]): run for run in report["runs"]}
    assert list(runs) == [("L2-2048", "shared"), ("L2-4096", "shared"), ("L2-2048", "reference"),
                          ("L2-4096", "reference"), ("L2-4096", "fresh")]
    assert runs["L2-2048", "shared"]["evictions"] > 0 and runs["L2-4096", "shared"]["evictions"] > 0
    assert all(runs[name, "reference"][counter] == 0 for name in ("L2-2048", "L2-4096")
               for counter in ("evictions", "loads", "recompute_preemptions"))
    assert report["cache"] == builtin_workload("L2-4096", seed=3, scale=0.25).cache.model_dump()
    assert (report["near_tie_tolerance"], report["model"], report["seed"], report["scale"]) == (1e-4, "tiny", 3, 0.25)


def test_validation_fails_a_workload_that_never_evicted(model, cheap_pair):
    progress = []
    report = validate_back_to_back(model, seed=4, scale=0.25, on_progress=lambda *update: progress.append(update))
    assert report.failures == ["smoke shared: never evicted to host (recompute preemptions: 0), so the run did not "
                               "exercise the host tier; use a larger --scale"]
    assert [run.label for run in report.runs] == ["smoke shared", "L2-2048 shared", "smoke reference",
                                                  "L2-2048 reference", "L2-2048 fresh"]
    assert report.runs[1].summary["evictions"] > 0
    assert progress[-1] == ("L2-2048 fresh", 8, 8)


def test_validate_exits_1_and_prints_each_failure(capsys, cheap_pair):
    assert main(["validate", "--scale", "0.25", "--seed", "4"]) == 1
    out = capsys.readouterr().out
    assert "batchgen validate: FAILED" in out
    assert [line for line in out.splitlines() if line.startswith("FAIL ")] == [
        "FAIL smoke shared: never evicted to host (recompute preemptions: 0), so the run did not exercise the "
        "host tier; use a larger --scale"]


def test_validation_reports_a_leak_and_stops(model, cheap_pair, monkeypatch):
    real_release = GpuKvPool.release_pages

    def release_all_but_one(pool, uuid):
        if uuid != "smoke-r1":
            real_release(pool, uuid)

    monkeypatch.setattr(GpuKvPool, "release_pages", release_all_but_one)
    report = validate_back_to_back(model)
    assert not report.ok and report.runs == ()
    assert len(report.failures) == 1
    assert re.fullmatch(r"smoke shared: integrity check failed at step \d+: "
                        r"gpu: pages owned by requests no longer live: \['smoke-r1'\]", report.failures[0])
