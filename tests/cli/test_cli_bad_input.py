"""Bad input to any command: one ``batchgen: error:`` line naming what was wrong, exit 2."""

import pytest
import torch
from cli_helpers import error_line

from batchgen.cli import main
from batchgen.engine.workloads import builtin_workload


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["run", "--workload", "L2-1024"],
            (
                "batchgen: error: unknown workload 'L2-1024'; built-in workloads are smoke,"
                " L2-2048, L2-4096, shared-prefix, or give the path of a workload JSON file"
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
