"""``scripts/bench_vllm.py`` without vLLM: its refusals of bad flags, its figures and table, the
checkpoint's geometry and tokenizer, and the runner's job file. (The benchmark itself installs
vLLM in a venv of its own and runs for many minutes: not part of the test suite.)"""

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_module(monkeypatch, name: str):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return __import__(name)


@pytest.fixture
def bench(monkeypatch):
    """The script, on a machine of two CPUs whatever runs the tests (its --threads check and its
    default "1,2" read the CPUs this process may use)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    return script_module(monkeypatch, "bench_vllm")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mixes", "static,bursty"], "--mixes takes a comma list of static, mixed"),
        (["--mixes", ","], "--mixes takes a comma list of static, mixed"),
        (["--threads", "0"], "--threads: each count in 1.."),
        (["--threads", "4096"], "--threads: each count in 1.."),
        (["--pairs", "0"], "--pairs needs >= 1"),
        (
            ["--page-size", "16"],
            "--page-size takes a multiple of 32 (both engines' KV blocks; vLLM's",
        ),
        (["--page-size", "0"], "--page-size takes a multiple of 32"),
        (["--geometry", "100x4"], "geometry '100x4': expected HxL with H a multiple of 64"),
        (["--geometry", "256x0"], "geometry '256x0': expected HxL"),
    ],
)
def test_bad_flags_are_refused_before_anything_is_installed_or_run(bench, capsys, flags, message):
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_help_explains_the_method_and_every_column(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    shown = capsys.readouterr().out
    for text in ("alternate", "ratio is the median over", "ceiling", "static  32 requests"):
        assert text in shown


def test_the_default_command_is_both_mixes_at_both_geometries_one_thread_and_two(bench):
    args = bench.parse_args([])
    assert list(args.geometries) == ["256x4", "512x8"]
    assert args.mixes == "static,mixed" and args.pairs == 5 and args.vocab_size == 4096
    assert args.page_size == 128  # vLLM's KV block size on a CPU, for both engines


def test_the_geometry_has_heads_of_32_and_two_query_heads_per_kv_head(bench):
    keys = bench.parse_args(["--geometry", "512x8"]).geometries["512x8"]
    assert keys == dict(
        hidden_size=512,
        intermediate_size=1360,  # 8 x 512 / 3 = 1365.3, rounded down to a multiple of 8
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=32,
        vocab_size=4096,
    )


def test_the_ratio_is_the_median_of_the_pairs_with_its_spread(bench):
    row = bench.summarize([2.0, 1.0, 4.0], [3.0, 2.0, 2.0], num_tokens=100)
    assert row["ratio"] == 1.5 and row["ratio_min"] == 0.5 and row["ratio_max"] == 2.0
    assert row["batchgen_tokens_per_s"] == 50.0 and row["vllm_tokens_per_s"] == 50.0


def test_pairs_of_unequal_counts_are_refused(bench):
    with pytest.raises(ValueError):
        bench.summarize([1.0, 2.0], [1.0], num_tokens=10)


def test_requests_differing_are_counted_by_request(bench):
    assert bench.differing_requests([[1, 2], [3], [4, 5]], [[1, 2], [3], [4, 6]]) == 1
    assert bench.differing_requests([[1, 2]], [[1, 2]]) == 0


def test_the_table_shows_every_figure_and_whether_tokens_are_equal(bench):
    from rich.console import Console

    row = dict(geometry="256x4", threads=2, mix="mixed", ratio=1.234, ratio_min=1.1, ratio_max=1.3)
    row.update(batchgen_tokens_per_s=2900.4, vllm_tokens_per_s=2350.0, batchgen_step_ms=9.87)
    row.update(vllm_step_ms=12.0, matmul_step_ms=1.75, ceiling=1.456, num_requests_differing=0)
    row.update(ratio_cpu=0.91, ratio_cpu_min=0.8, ratio_cpu_max=1.0)
    console = Console(width=200, record=True)
    console.print(bench.render([row, {**row, "num_requests_differing": 3}], "t"))
    lines = console.export_text().splitlines()
    cells = [line for line in lines if "256x4" in line]
    assert len(cells) == 2
    figures = ("2900", "2350", "1.23x", "1.10-1.30", "0.91x (0.80-1.00)", "9.9 | 12.0", "1.8")
    for text in (*figures, "1.46x"):
        assert text in cells[0]
    assert "equal" in cells[0] and "3 differ" in cells[1]


def test_the_checkpoint_has_a_tokenizer_of_its_whole_vocabulary(monkeypatch, tmp_path):
    job = script_module(monkeypatch, "vllm_job")
    transformers = pytest.importorskip("transformers")
    keys = job.geometry("64x1", vocab_size=50)
    job.save_checkpoint_with_tokenizer(str(tmp_path), keys, seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"] == 50
    assert tokenizer.convert_ids_to_tokens([0, 49]) == ["t0", "t49"]


def test_both_mixes_have_the_documented_sizes_and_are_seeded(monkeypatch):
    job = script_module(monkeypatch, "vllm_job")
    static, mixed = job.build_mixes(["static", "mixed"], vocab_size=4096, seed=3)
    assert (len(static.prompts), static.max_num_seqs, set(static.new_tokens)) == (32, 32, {64})
    assert (len(mixed.prompts), mixed.max_num_seqs) == (64, 16)
    assert all(16 <= n <= 256 for n in mixed.new_tokens)
    assert all(16 <= len(p) <= 128 and 0 < min(p) for p in static.prompts + mixed.prompts)
    again = job.build_mixes(["static", "mixed"], vocab_size=4096, seed=3)
    assert again[1].prompts == mixed.prompts and again[1].new_tokens == mixed.new_tokens


def test_the_runner_refuses_a_job_lacking_a_setting_by_name(monkeypatch, tmp_path):
    runner = script_module(monkeypatch, "vllm_runner")
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"checkpoint": "x", "dtype": "float32"}))
    with pytest.raises(ValueError, match="lacks max_num_seqs, max_model_len, max_num_batched"):
        runner.read_job(str(path))


def test_vllm_runs_with_the_page_size_batchgen_runs_and_no_prefix_cache(monkeypatch, tmp_path):
    job = script_module(monkeypatch, "vllm_job")
    started = []
    # ldconfig, which finds tcmalloc, would run under the stand-in Popen
    monkeypatch.setattr(job, "vllm_preload", lambda: "libtcmalloc_minimal.so.4")

    class Process:  # the runner process, ready at once and never started
        def __init__(self, argv, **kwargs):
            started.append((argv, kwargs["env"]))
            self.stdout = io.StringIO('{"ready": true}\n')

    monkeypatch.setattr(job.subprocess, "Popen", Process)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    mix = job.build_mixes(["mixed"], vocab_size=64, seed=0)[0]
    job.VllmRunner(Path("python"), str(tmp_path), mix, 2, 128, tmp_path / "vllm.log")
    settings = json.loads((tmp_path / "vllm-job-mixed.json").read_text())
    assert settings["engine_args"] == {"enable_prefix_caching": False, "block_size": 128}
    assert settings["max_num_seqs"] == 16 and settings["dtype"] == "float32"
    assert started[0][1]["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert started[0][1]["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    assert settings["cpus"] == [0, 1]


@pytest.mark.parametrize(
    "found, inherited, expected",
    [
        ("libtcmalloc_minimal.so.4", "", "libtcmalloc_minimal.so.4"),
        ("libtcmalloc_minimal.so.4", "libx.so", "libtcmalloc_minimal.so.4:libx.so"),
        (None, "libx.so", "libx.so"),
        (None, "", ""),
    ],
)
def test_vllm_gets_tcmalloc_preloaded_where_the_system_has_it(
    monkeypatch, found, inherited, expected
):
    job = script_module(monkeypatch, "vllm_job")
    monkeypatch.setattr(job.ctypes.util, "find_library", lambda name: found)
    monkeypatch.setenv("LD_PRELOAD", inherited)
    assert job.vllm_preload() == expected


def test_the_whole_vllm_engine_is_confined_to_the_cpus_before_it_is_built(monkeypatch, tmp_path):
    runner = script_module(monkeypatch, "vllm_runner")
    events = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: events.append((pid, cpus)))
    monkeypatch.setattr(runner, "build_llm", lambda job: events.append("built") or "llm")
    path = tmp_path / "job.json"
    job = dict(checkpoint="x", max_num_seqs=16, max_model_len=512, max_num_batched_tokens=4096)
    path.write_text(json.dumps(dict(job, dtype="float32", cpus=[0])))
    assert runner.start_engine(str(path)) == "llm"
    assert events == [(0, [0]), "built"]


# a parent that starts a child and waits on it, as the runner and vLLM's engine core do
PARENT_AND_CHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
child.wait()
"""


def stopped(pids: list[int], timeout_s: float = 5.0) -> list[bool]:
    """Whether each of ``pids`` is stopped (state T in ``/proc/PID/stat``), once every one is or
    ``timeout_s`` has passed: a signal takes effect when its process next runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for pid in pids:
            with open(f"/proc/{pid}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0] == "T")
        if all(states) or time.monotonic() > deadline:
            return states
        time.sleep(0.01)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_paused_stops_every_process_of_the_runner_until_the_block_ends(monkeypatch):
    job = script_module(monkeypatch, "vllm_job")
    runner = object.__new__(job.VllmRunner)  # its process only; no vLLM started
    runner.process = subprocess.Popen(
        [sys.executable, "-c", PARENT_AND_CHILD],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    child = int(runner.process.stdout.readline())
    try:
        with runner.paused():
            assert stopped([runner.process.pid, child]) == [True, True]
        assert stopped([runner.process.pid, child], timeout_s=0) == [False, False]
    finally:
        os.killpg(runner.process.pid, 9)
        runner.process.wait()


def test_a_venv_is_ready_only_once_its_stamp_names_both_specs(monkeypatch, tmp_path):
    venv = script_module(monkeypatch, "vllm_venv")
    assert not venv.is_ready(tmp_path)
    (tmp_path / venv.STAMP).write_text(f"{venv.TORCH_SPEC}\n")
    assert not venv.is_ready(tmp_path)
    (tmp_path / venv.STAMP).write_text(f"{venv.TORCH_SPEC} {venv.VLLM_SPEC}\n")
    assert venv.is_ready(tmp_path)


def test_the_matmul_time_of_a_decode_step_is_positive_and_runs_every_linear(monkeypatch):
    bound = script_module(monkeypatch, "decode_bound")
    from batchgen.config import TINY_MODELS
    from batchgen.model.loader import load_model

    model = load_model(next(iter(TINY_MODELS)))
    calls = []
    for module in [*model.model.layers.modules(), model.lm_head]:
        if isinstance(module, bound.LINEARS):
            module.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    assert bound.matmul_step_s(model, num_rows=3, repeats=2) > 0
    assert calls == [3] * len(calls) and len(calls) == 2 * (4 * model.config.num_layers + 1)


def test_every_matmul_of_a_forward_is_timed_inside_the_block_and_none_after_it(monkeypatch):
    bound = script_module(monkeypatch, "decode_bound")
    import time

    from batchgen.config import TINY_MODELS
    from batchgen.model.llama import SeqInput
    from batchgen.model.loader import load_model
    from batchgen.model.paged_kv import kv_page_shape

    model = load_model(next(iter(TINY_MODELS)))
    pages = torch.zeros(kv_page_shape(model.config, 16, 2))
    clock = iter(range(1000))  # every perf_counter call one second later than the last
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    # a layer's matmuls: qkv, o, gate/up and down; then lm_head: one second each
    num_matmuls = 4 * model.config.num_layers + 1
    with bound.timed_linears(model) as seconds:
        model.forward([SeqInput([1, 2, 3], 0, [0])], pages)
    assert seconds == [num_matmuls]
    model.forward([SeqInput([1, 2, 3], 0, [1])], pages)
    assert seconds == [num_matmuls]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
