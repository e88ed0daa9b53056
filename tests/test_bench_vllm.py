"""``scripts/bench.py vllm`` (``scripts/benchmarks/vllm_bench.py``) without vLLM: its refusals of
bad flags, its figures and table, the checkpoint's geometry and tokenizer, the runner's job file;
with ``--model real`` its cells, mix, token comparison, resumption, step breakdown and
time-to-first-token timing. (The benchmark itself installs vLLM in a venv of its own and runs for
many minutes: not part of the test suite.)"""

import importlib
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
    """A module of ``scripts/benchmarks/``."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module(f"benchmarks.{name}")


@pytest.fixture
def bench(monkeypatch):
    """The benchmark, on a machine of two CPUs whatever runs the tests (its --threads check and its
    default "1,2" read the CPUs this process may use)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    return script_module(monkeypatch, "vllm_bench")


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


def test_the_ratio_is_the_median_of_the_pairs_with_its_spread(monkeypatch):
    measure = script_module(monkeypatch, "vllm_measure")
    row = measure.summarize([2.0, 1.0, 4.0], [3.0, 2.0, 2.0], num_tokens=100)
    assert row["ratio"] == 1.5 and row["ratio_min"] == 0.5 and row["ratio_max"] == 2.0
    assert row["batchgen_tokens_per_s"] == 50.0 and row["vllm_tokens_per_s"] == 50.0


def test_pairs_of_unequal_counts_are_refused(monkeypatch):
    with pytest.raises(ValueError):
        script_module(monkeypatch, "vllm_measure").summarize([1.0, 2.0], [1.0], num_tokens=10)


def test_requests_differing_are_counted_by_request(monkeypatch):
    differing_requests = script_module(monkeypatch, "vllm_measure").differing_requests
    assert differing_requests([[1, 2], [3], [4, 5]], [[1, 2], [3], [4, 6]]) == 1
    assert differing_requests([[1, 2]], [[1, 2]]) == 0


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


# ---- --model real: its flags, cells, mix, token comparison, breakdown and time to first token ---


def test_the_real_model_runs_every_cell_and_the_first_token_by_default(bench):
    args = bench.parse_args(["--model", "real"])
    assert args.cell_names == ["1t-fp32-16", "1t-fp32-64", "1t-bf16-64", "2t-fp32-64", "ttft"]
    assert bench.parse_args([]).model == "seeded"


def test_cells_are_taken_by_name_once_each_in_the_order_given(bench):
    args = bench.parse_args(["--model", "real", "--cells", "ttft, 1t-bf16-64,ttft"])
    assert args.cell_names == ["ttft", "1t-bf16-64"]
    real = script_module_of(bench, "vllm_real")
    cell = real.CELLS["1t-bf16-64"]
    assert (cell.threads, cell.dtype, cell.max_num_seqs) == (1, "bfloat16", 64)
    assert {name: c.threads for name, c in real.CELLS.items()}["2t-fp32-64"] == 2


def script_module_of(bench, name: str):
    """A helper module of the benchmark, as the benchmark imported it."""
    return sys.modules[f"benchmarks.{name}"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "real", "--cells", "1t-fp32-32"], "--cells takes a comma list of 1t-fp32-16"),
        (["--model", "real", "--cells", ","], "--cells takes a comma list of"),
        (["--resume"], "--resume needs --model real and --json-out"),
        (["--model", "real", "--resume"], "--resume needs --model real and --json-out"),
        (["--model", "llama"], "argument --model: invalid choice"),
    ],
)
def test_bad_real_model_flags_are_refused(bench, capsys, flags, message):
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_two_thread_cell_is_refused_on_one_cpu(bench, monkeypatch, capsys):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "real", "--cells", "1t-fp32-16,2t-fp32-64"])
    assert "--cells 2t-fp32-64: more threads than this machine's CPUs" in capsys.readouterr().err
    assert bench.parse_args(["--model", "real", "--cells", "1t-fp32-16"]).cell_names


def test_the_real_mix_is_64_seeded_requests_of_ordinary_tokens_to_128_new_tokens(monkeypatch):
    real = script_module(monkeypatch, "vllm_real")
    mix = real.real_mix(16, vocab_size=49152, seed=0)
    assert (len(mix.prompts), mix.max_num_seqs, set(mix.new_tokens)) == (64, 16, {128})
    assert all(16 <= len(prompt) <= 256 for prompt in mix.prompts)
    ids = [token for prompt in mix.prompts for token in prompt]
    assert min(ids) >= 17 and max(ids) < 49152  # no special token: ids 0-16 are SmolLM2's
    assert len({len(prompt) for prompt in mix.prompts}) > 30  # lengths spread over the range
    assert real.real_mix(64, 49152, seed=0).prompts == mix.prompts
    assert real.real_mix(16, 49152, seed=1).prompts != mix.prompts


def test_vllm_gets_a_kv_cache_that_holds_every_request_with_a_gib_to_spare(monkeypatch):
    real = script_module(monkeypatch, "vllm_real")
    from batchgen.config import ModelConfig

    config = ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, max_context=8192,
    )  # fmt: skip
    mix = real.Mix("m", [[1] * 200] * 64, [128] * 64, 64, ("fcfs",))
    # 64 requests of 328 tokens: 3 pages of 128 each, 46,080 bytes a token in float32: 1.05 GiB
    assert real.kv_cache_gib(mix, config, "float32", page_size=128) == 3
    assert real.kv_cache_gib(mix, config, "bfloat16", page_size=128) == 2


def test_tokens_are_compared_under_the_near_tie_rule(monkeypatch):
    measure = script_module(monkeypatch, "vllm_measure")
    from batchgen.state import Phase, RequestOutput, TokenLogprobs

    def output(tokens, gap):
        logprobs = [TokenLogprobs((t, t + 1), (-1.0, -1.0 - gap)) for t in tokens]
        return RequestOutput("r", Phase.FINISHED, "length", tuple(tokens), tuple(logprobs))

    ours = [output([5, 6], 1.0), output([5, 6], 1e-6), output([5, 6], 1.0), output([5], 1.0)]
    theirs = [[5, 6], [5, 7], [5, 7], [5, 6]]
    assert measure.compare_tokens(ours, theirs, tolerance=1e-4) == dict(
        equal=1, near_tie=1, differing=2
    )


def test_the_tokens_column_counts_near_ties_and_in_bfloat16_the_requests_equal(bench):
    row = dict(num_requests=64, num_requests_equal=60, num_requests_near_tie=0)
    assert bench.tokens_text(dict(row, num_requests_differing=0)) == "equal"
    assert bench.tokens_text(dict(row, num_requests_near_tie=2, num_requests_differing=1)) == (
        "2 near-tie, 1 differ"
    )
    bf16 = dict(row, dtype="bfloat16", num_requests_differing=3, num_requests_near_tie=1)
    assert bench.tokens_text(bf16) == "60/64 equal (1 near-tie, 3 differ)"
    assert bench.tokens_text(dict(bf16, num_requests_equal=64, num_requests_differing=0,
                                  num_requests_near_tie=0)) == "64/64 equal"  # fmt: skip


def test_vllm_runs_the_real_cells_dtype_budget_and_cache_from_a_job_beside_the_checkpoint(
    monkeypatch, tmp_path
):
    job = script_module(monkeypatch, "vllm_job")
    started = []

    class Process:
        def __init__(self, argv, **kwargs):
            started.append(kwargs["env"])
            self.stdout = io.StringIO('{"ready": true}\n')

    monkeypatch.setattr(job.subprocess, "Popen", Process)
    monkeypatch.setattr(job, "vllm_preload", lambda: "")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    mix = job.build_mixes(["mixed"], vocab_size=64, seed=0)[0]
    checkpoint, workdir = tmp_path / "model", tmp_path / "work"
    checkpoint.mkdir(), workdir.mkdir()
    job.VllmRunner(
        Path("python"), str(checkpoint), mix, 1, 128, tmp_path / "log", workdir=str(workdir),
        dtype="bfloat16", batched_tokens=9000, kv_cache_gib=3,
    )  # fmt: skip
    assert not list(checkpoint.iterdir())  # the model's directory is left as it was
    settings = json.loads((workdir / "vllm-job-mixed.json").read_text())
    assert settings["dtype"] == "bfloat16" and settings["max_num_batched_tokens"] == 9000
    assert settings["checkpoint"] == str(checkpoint) and settings["cpus"] == [0]
    assert started[0]["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_batchgen_runs_every_request_to_its_length_as_vllm_with_ignore_eos(monkeypatch):
    measure = script_module(monkeypatch, "vllm_measure")
    from batchgen.config import TINY_MODELS
    from batchgen.model.loader import load_model

    model = load_model(next(iter(TINY_MODELS)))
    # every token an EOS id: each request would end at its first token
    everything = tuple(range(model.config.vocab_size))
    model.config = model.config.model_copy(update={"eos_token_ids": everything})
    mix = script_module(monkeypatch, "throughput").Mix("m", [[1, 2, 3]] * 2, [5, 7], 2, ("fcfs",))
    run = measure.run_batchgen_counting(model, mix, page_size=32)
    assert [len(tokens) for tokens in run["outputs"]] == [5, 7]
    assert [output.finish_reason for output in run["results"]] == ["length", "length"]


def test_the_step_breakdown_splits_steady_decode_steps_into_shares_that_add_up(monkeypatch):
    bound = script_module(monkeypatch, "decode_bound")
    throughput = script_module(monkeypatch, "throughput")
    from batchgen.config import TINY_MODELS
    from batchgen.model.loader import load_model

    model = load_model(next(iter(TINY_MODELS)))
    mix = throughput.Mix("m", [[1, 2, 3]] * 4 + [[4, 5]], [6] * 5, 4, ("fcfs",))
    worker, job = throughput.new_worker(model, mix, "cpu", page_size=32)
    methods = {kind: kind.attend for kind in bound.DECODE_KINDS}
    row = bound.step_breakdown(model, worker, job)
    # steps 1-5 decode the first four requests, four rows each; the fifth runs after them alone
    assert row["rows"] == 4 and row["num_steps"] == 5
    shares = [row[f"{part}_share"] for part in ("layer_matmuls", "lm_head", "decode_attention")]
    assert all(0 < share < 1 for share in shares)
    assert sum(shares) + row["rest_share"] == pytest.approx(1)
    assert row["step_ms"] > 0 and row["matmul_only_ms"] > 0
    assert methods == {kind: kind.attend for kind in bound.DECODE_KINDS}  # put back after it
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_the_breakdown_table_shows_each_part_of_the_step(bench):
    from rich.console import Console

    parts = dict(rows=64, step_ms=321.0, matmul_only_ms=180.2, layer_matmuls_share=0.48)
    parts.update(lm_head_share=0.12, decode_attention_share=0.26, rest_share=0.14)
    console = Console(width=200, record=True)
    real = script_module_of(bench, "vllm_real")
    console.print(real.render_breakdown([dict(cell="1t-fp32-64", breakdown=parts)]))
    line = next(line for line in console.export_text().splitlines() if "1t-fp32-64" in line)
    for text in ("64", "321.0", "48.0%", "12.0%", "26.0%", "14.0%", "180.2"):
        assert text in line


def test_a_resumed_run_keeps_the_cells_it_holds_and_writes_after_each(bench, monkeypatch, tmp_path):
    args = bench.parse_args(["--model", "real", "--json-out", str(tmp_path / "r.json")])
    ran, written = [], []
    monkeypatch.setattr(
        bench, "run_cell", lambda name, *rest: ran.append(name) or dict(cell=name, ratio=1.0)
    )
    monkeypatch.setattr(bench, "measure_ttft", lambda *rest: ran.append("ttft") or {"warm_s": {}})
    monkeypatch.setattr(bench, "write_output", lambda p, text: written.append(json.loads(text)))
    from rich.console import Console

    record = {"rows": [dict(cell="1t-fp32-64", ratio=1.3)]}
    bench.run_real(args, Path("python"), Console(file=io.StringIO()), tmp_path / "log", record)
    assert ran == ["1t-fp32-16", "1t-bf16-64", "2t-fp32-64", "ttft"]
    assert [row["cell"] for row in record["rows"]] == [
        "1t-fp32-16", "1t-fp32-64", "1t-bf16-64", "2t-fp32-64"
    ]  # fmt: skip
    assert record["rows"][1]["ratio"] == 1.3 and "ttft" in record
    assert len(written) == 4 and [row["cell"] for row in written[0]["rows"]] == [
        "1t-fp32-16", "1t-fp32-64"
    ]  # fmt: skip


def test_the_first_token_is_timed_on_one_chat_line_of_one_token(monkeypatch, tmp_path):
    ttft = script_module(monkeypatch, "vllm_ttft")
    line = json.loads(ttft.chat_line("Hi"))
    assert line["url"] == "/v1/chat/completions" and line["body"]["max_tokens"] == 1
    assert line["body"]["messages"] == [{"role": "user", "content": "Hi"}]
    assert line["body"]["model"] == ttft.SERVED_NAME and line["body"]["temperature"] == 0
    command = ttft.batchgen_command("model-dir", tmp_path)
    assert command[1:4] == ["-m", "batchgen", "generate"]
    for flag, value in (("--model", "model-dir"), ("--threads", "1"), ("-i", "ttft.jsonl")):
        assert Path(command[command.index(flag) + 1]).name == value
    assert "--json" in command and "--served-model-name" in command
    vllm = ttft.vllm_command(Path("py"), "model-dir")
    assert vllm[2:] == ["--first-token", "model-dir", "float32", "0", ttft.PROMPT]


def test_the_first_line_of_a_process_is_timed_and_a_process_without_one_is_named(
    monkeypatch, tmp_path
):
    ttft = script_module(monkeypatch, "vllm_ttft")
    monkeypatch.setattr(ttft, "CPUS", sorted(os.sched_getaffinity(0))[:1])

    def timed(line: str, sleep: float = 0.0) -> float:
        script = (
            f"import time; print('loading'); time.sleep(0.2); print({line!r}); time.sleep({sleep})"
        )
        return ttft.first_line_s([sys.executable, "-c", script], dict(os.environ), tmp_path / "l")

    assert 0.2 <= timed('{"tokens_generated": 1}', sleep=0.3) < 0.45  # not waiting for the exit
    assert timed('{"token_ids": [7]}') >= 0.2
    with pytest.raises(RuntimeError, match="exited .*; see .*l"):
        timed("no JSON line")
    with pytest.raises(RuntimeError, match="gave no token"):
        timed('{"tokens_generated": 0, "lines_failed": 1}')
