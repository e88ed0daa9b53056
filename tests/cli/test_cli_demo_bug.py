"""Your first divergence: the demo switch plants a known bug in the shadow path only (the job's
output stays right), the log records it, the run exits 0 and ends with one stderr line saying
where its divergences are, and report, replay and minimize work on that log end to end."""

import json
import shlex
from pathlib import Path

import pytest
from cli_helpers import num_divergences

from batchgen.cli import main
from batchgen.text.tiny_checkpoint import make_checkpoint
from compare import DivergenceRecord, read_log

GOLDEN = Path(__file__).parents[1] / "golden" / "smoke_reversed_grants.jsonl"


def run_smoke(tmp_path, name: str, *flags: str) -> tuple[Path, Path]:
    """``batchgen run --workload smoke --kv-compare log`` with ``flags``: its log and outputs."""
    log, outputs = tmp_path / f"{name}.jsonl", tmp_path / f"{name}-outputs.jsonl"
    argv = ["run", "--workload", "smoke", "--kv-compare", "log", "--kv-compare-log", str(log)]
    assert main([*argv, "--outputs", str(outputs), "--json", *flags]) == 0
    return log, outputs


@pytest.fixture(scope="module")
def demo_log(tmp_path_factory) -> Path:
    """smoke with the demo switch's reversed grants planted in the shadow (legacy) path."""
    log, _ = run_smoke(
        tmp_path_factory.mktemp("demo"), "demo", "--kv-compare-demo-bug=reversed-grants"
    )
    return log


@pytest.mark.parametrize("kv_path", ["plan", "legacy"])
def test_the_demo_bug_diverges_the_shadow_path_only_and_the_outputs_stay_the_same(
    kv_path, tmp_path
):
    path = ["--kv-path", kv_path]
    _, right = run_smoke(tmp_path, "right", *path)
    log, planted = run_smoke(tmp_path, "planted", *path, "--kv-compare-demo-bug", "reversed-grants")
    assert planted.read_text() == right.read_text()  # the tokens of every request, in order
    records = [r for r in read_log(log).records if isinstance(r, DivergenceRecord)]
    assert len(records) == 6 and {r.op for r in records} == {"alloc"}
    assert {(r.authoritative, r.replay["demo_bug"]) for r in records} == {
        (kv_path, "reversed-grants")
    }


def test_a_run_that_logged_divergences_exits_0_and_ends_with_one_line_pointing_to_them(
    demo_log, tmp_path, capsys
):
    log = tmp_path / "my log.jsonl"
    argv = ["run", "--workload", "smoke", "--kv-compare", "log", "--kv-compare-log", str(log)]
    assert main([*argv, "--kv-compare-demo-bug", "evict-at-watermark"]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"batchgen: 2 divergences logged to {log}; see them:"
        f" batchgen report {shlex.quote(str(log))}"
    )
    assert main([*argv, "--kv-compare-log", str(tmp_path / "clean.jsonl")]) == 0
    assert "logged to" not in capsys.readouterr().err


def test_the_demo_bug_is_read_from_the_environment_and_an_option_turns_it_off(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("BATCHGEN_WORKER_KV_COMPARE_DEMO_BUG", "reversed-grants")
    log, _ = run_smoke(tmp_path, "env")
    assert num_divergences(log) == 6
    log, _ = run_smoke(tmp_path, "off", "--kv-compare-demo-bug", "off")
    assert num_divergences(log) == 0


def test_replay_plants_the_recorded_demo_bug_again_and_reproduces_the_divergence(demo_log, capsys):
    assert main(["replay", str(demo_log), "--index", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "demo bug:  reversed-grants, planted in the shadow path (legacy) by"
        " --kv-compare-demo-bug, and in the replay",
        "logged:   state divergence at 4 field paths",
        "    requests[smoke-r0].gpu_page_ids[0..1]  plan: [0, 1]  legacy: [4, 3]",
        "    requests[smoke-r0].gpu_page_ids[3..4]  plan: [3, 4]  legacy: [1, 0]",
        "replayed: state divergence at 4 field paths, the values logged",
        "reproduced: yes",
    ]


def test_the_golden_log_replays_with_its_divergence(capsys):
    assert main(["replay", str(GOLDEN), "--index", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "reproduced: yes"


def test_report_lists_the_demo_divergences_values_before_the_coverage(demo_log, capsys):
    assert main(["report", str(demo_log)]) == 1
    out = capsys.readouterr().out
    assert out.index("By field path") < out.index("Decision coverage")
    assert "requests[smoke-r0].gpu_page_ids[0..1]" in out
    assert "  plan: [0, 1]" in out and "  legacy: [4, 3]" in out


def test_minimize_plants_the_recorded_demo_bug_in_its_candidates_and_its_test(
    demo_log, tmp_path, capsys
):
    out_dir = tmp_path / "minimized"
    assert main(["minimize", str(demo_log), "--index", "0", "--out-dir", str(out_dir)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("alloc state divergence (requests[*].gpu_page_ids[*]): requests 8 -> 1")
    assert first.endswith(", demo bug reversed-grants planted in the shadow path")
    [test] = out_dir.glob("test_kv_*.py")
    assert 'compare_demo_bug="reversed-grants"' in test.read_text()


def test_generate_that_logged_divergences_ends_with_the_same_line(tmp_path, capsys):
    checkpoint = make_checkpoint(tmp_path / "tiny-ckpt")
    body = {"prompt": "Once upon a time", "max_tokens": 4}
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    log = tmp_path / "kv.jsonl"
    argv = ["generate", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    flags = [
        "--model",
        str(checkpoint),
        "--gpu-pages",
        "64",
        "--host-pages",
        "8",
        "--page-size",
        "4",
    ]
    demo = ["--kv-compare", "log", "--kv-compare-log", str(log), "--kv-compare-demo-bug"]
    assert main([*argv, *flags, *demo, "reversed-grants", "--json"]) == 0
    count = num_divergences(log)
    assert count and capsys.readouterr().err.splitlines()[-1] == (
        f"batchgen: {count} divergence{'s' if count > 1 else ''} logged to {log}; see them:"
        f" batchgen report {log}"
    )
