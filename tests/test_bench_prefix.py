"""``scripts/bench.py prefix`` (``scripts/benchmarks/prefix.py``) without vLLM: its refusals of bad
flags, its jobs (chat lines sharing exactly the tokens asked for; the same lengths sharing
nothing), batchgen's side on the tiny model (prefill tokens computed, hit tokens, tokens equal with
caching on and off), its ratios, goals and tables from given runs, and vLLM's runner job with its
prefix cache on. (With vLLM the benchmark runs for many minutes: not part of the test suite.)"""

import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from batchgen.model.loader import load_model
from batchgen.text.tiny_checkpoint import make_checkpoint

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_module(monkeypatch, name: str):
    """A module of ``scripts/benchmarks/``."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module(f"benchmarks.{name}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny model as an HF directory with a BPE tokenizer and a chat template."""
    return make_checkpoint(tmp_path_factory.mktemp("prefix") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lines", "1"], "--lines needs >= 2 (lines that share a prefix), got 1"),
        (["--pairs", "0"], "--new-tokens, --pairs, --max-num-seqs and --shared-tokens need >= 1"),
        (["--threads", "3"], "--threads takes 1..2 (this machine's CPUs), got 3"),
        (["--page-size", "48"], "--page-size takes a multiple of 32 (vLLM's CPU blocks), got 48"),
        (["--shared-tokens", "100"], "--shared-tokens 100 is under one page of 128: no page"),
        (["--no-vllm", "--vllm-unique"], "--vllm-unique needs vLLM: leave out --no-vllm"),
    ],
)
def test_bad_flags_are_refused_before_anything_is_loaded(monkeypatch, capsys, flags, message):
    prefix = script_module(monkeypatch, "prefix")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(SystemExit) as exited:
        prefix.parse_args(flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_default_command_is_the_issue_s_job_with_every_cell(monkeypatch):
    prefix = script_module(monkeypatch, "prefix")
    args = prefix.parse_args([])
    assert (args.lines, args.new_tokens, args.threads, args.shared_tokens) == (256, 64, 1, 512)
    assert (args.page_size, args.max_num_seqs, args.pairs) == (128, 64, 3)
    assert prefix.cell_names(args) == [
        "shared batchgen off",
        "shared batchgen on",
        "shared vllm off",
        "shared vllm on",
        "unique batchgen off",
        "unique batchgen on",
    ]
    assert prefix.cell_names(prefix.parse_args(["--vllm-unique"]))[-2:] == [
        "unique vllm off",
        "unique vllm on",
    ]
    assert len(prefix.cell_names(prefix.parse_args(["--no-vllm"]))) == 4


def test_the_entry_point_lists_prefix_and_each_cell_warms_up_on_two_lines(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    assert importlib.import_module("bench").main(["--help"]) == 0
    assert (
        "\n  prefix            prefix caching on and off, batchgen against"
        in capsys.readouterr().out
    )
    prefix = script_module(monkeypatch, "prefix")
    job = prefix.Mix("shared", [[5, 6], [5, 7], [5, 8]], [4, 4, 4], 2, ("fcfs",))
    warm = prefix.warm_up_job(job)
    assert (warm.prompts, warm.new_tokens, warm.max_num_seqs) == ([[5, 6], [5, 7]], [4, 4], 2)


def test_shared_lines_share_exactly_the_tokens_asked_for_and_unique_lines_nothing(
    monkeypatch, tokenizer
):
    jobs = script_module(monkeypatch, "prefix_jobs")
    shared = jobs.shared_job(tokenizer, lines=5, shared_tokens=64, new_tokens=3, at_once=2)
    assert jobs.common_prefix(shared.prompts) == 64
    assert len({tuple(prompt) for prompt in shared.prompts}) == 5
    assert (shared.new_tokens, shared.max_num_seqs) == ([3] * 5, 2)
    system = jobs.system_prompt(tokenizer, 64)
    assert jobs.question(4) == "4. Which rule above matters most for scheduling, and why?"
    assert shared.prompts[4] == jobs.chat_ids(tokenizer, system, jobs.question(4))
    unique = jobs.unique_job(shared, tokenizer, vocab_size=512, seed=0)
    assert [len(p) for p in unique.prompts] == [len(p) for p in shared.prompts]
    assert jobs.common_prefix(unique.prompts) == 0 and unique.new_tokens == shared.new_tokens
    first_ordinary = max(tokenizer.added_tokens_decoder) + 1
    assert min(min(p) for p in unique.prompts) >= first_ordinary
    assert max(max(p) for p in unique.prompts) < 512


class WordTokenizer:
    """A chat template of two tokens per word of the system prompt: only even counts are made."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        system, question = (message["content"] for message in messages)
        return [1, *[7, 8] * len(system.split()), 2, *map(ord, question), 3]


def test_a_shared_count_no_system_prompt_gives_is_refused_naming_the_next(monkeypatch):
    jobs = script_module(monkeypatch, "prefix_jobs")
    # "1. Answer" shares 6 tokens, "1. Answer in" 8, "1. Answer in plain" 10
    assert jobs.system_prompt(WordTokenizer(), 8) == "1. Answer in"
    with pytest.raises(ValueError) as refused:
        jobs.system_prompt(WordTokenizer(), 9)
    assert str(refused.value) == (
        "--shared-tokens 9: no system prompt gives exactly that many shared tokens with this"
        " tokenizer (the next has 10); try 10"
    )


def test_batchgen_computes_only_the_unique_share_with_caching_and_the_same_tokens(
    monkeypatch, tokenizer, tiny_dir
):
    jobs = script_module(monkeypatch, "prefix_jobs")
    model = load_model(str(tiny_dir))
    shared = jobs.shared_job(tokenizer, lines=6, shared_tokens=64, new_tokens=4, at_once=4)
    lengths = sum(map(len, shared.prompts))
    off = jobs.run_batchgen(model, shared, page_size=32, caching=False)
    on = jobs.run_batchgen(model, shared, page_size=32, caching=True)
    assert (off["prefill_tokens"], off["hit_tokens"], off["query_tokens"]) == (lengths, 0, 0)
    # the first line computes all of its prompt, the 5 others all but the 64 shared tokens
    assert on["prefill_tokens"] == lengths - 5 * 64 and on["hit_tokens"] == 5 * 64
    assert on["query_tokens"] == lengths
    assert on["outputs"] == off["outputs"] and all(len(out) == 4 for out in on["outputs"])
    assert [r.num_cached_prompt_tokens for r in on["results"]] == [0, 64, 64, 64, 64, 64]
    worker, job = jobs.new_worker(model, shared, page_size=32, caching=True)
    # 4 lines at once, each of pages_needed(prompt + 4, 32) pages, and one more
    longest = sorted(len(p) + 4 for p in shared.prompts)[-4:]
    assert job.cache.num_gpu_pages == sum(-(-n // 32) for n in longest) + 1
    assert job.engine.max_num_batched_tokens == jobs.at_once_tokens(shared)
    assert worker.model_config.eos_token_ids == ()
    assert "forward" not in vars(model)  # the counting wrapper is gone after the run


def test_the_subcommand_runs_batchgen_s_cells_and_judges_what_it_can_without_vllm(
    tiny_dir, tmp_path
):
    out = tmp_path / "prefix.json"
    flags = ["--model", str(tiny_dir), "--no-vllm", "--lines", "6", "--max-num-seqs", "4"]
    flags += ["--new-tokens", "4", "--shared-tokens", "64", "--page-size", "32", "--pairs", "2"]
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench.py"), "prefix", *flags, "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads(out.read_text())
    cells = figures["summary"]["cells"]
    assert list(cells) == [
        "shared batchgen off",
        "shared batchgen on",
        "unique batchgen off",
        "unique batchgen on",
    ]
    share = figures["summary"]["unique_share"]
    assert share == figures["summary"]["prompt_tokens"] - 5 * 64
    assert cells["shared batchgen on"]["prefill_tokens"] == share
    assert cells["unique batchgen on"]["hit_tokens"] == 0
    assert [len(runs) for runs in figures["runs"].values()] == [2, 2, 2, 2]
    assert figures["tokens"]["batchgen on vs off"] == dict(
        equal=12, near_tie=0, differing=0, requests=12
    )
    assert figures["tokens"]["later runs vs their first"]["equal"] == 4 * 1 * 6
    verdicts = [(goal["goal"], goal["verdict"]) for goal in figures["goals"]]
    assert verdicts[0] == ("caching on computes only the unique share", "met")
    assert verdicts[1:3] == [
        ("shared: caching speeds batchgen >= vLLM", "n/a"),
        ("caching on: >= 1.25x vLLM", "n/a"),
    ]
    assert "1-minute load average after each timed run: " in done.stdout
    assert figures["summary"]["matmul_s"] is None and "ceiling" not in figures["summary"]


def runs_of(walls: dict, prefill: dict) -> dict:
    """``measure``'s answer for given walls per cell (each run's CPU seconds half its wall)."""
    runs = {
        cell: [dict(wall_s=w, cpu_s=w / 2, prefill_tokens=prefill[cell], hit_tokens=0) for w in ws]
        for cell, ws in walls.items()
    }
    return dict(first={cell: rs[0] for cell, rs in runs.items()}, runs=runs, matmul_s=10.0)


WALLS = {
    "shared batchgen off": [30.0, 32.0, 34.0],
    "shared batchgen on": [10.0, 10.0, 17.0],
    "shared vllm off": [36.0, 36.0, 36.0],
    "shared vllm on": [12.0, 18.0, 12.0],
    "unique batchgen off": [20.0, 20.0, 20.0],
    "unique batchgen on": [20.2, 20.6, 19.8],
}


def summary_of(monkeypatch, walls: dict, computed: int) -> dict:
    report = script_module(monkeypatch, "prefix_report")
    jobs = script_module(monkeypatch, "prefix_jobs")
    shared = jobs.Mix("shared", [[5] * 300] * 4, [2] * 4, 4, ("fcfs",))
    prefill = dict.fromkeys(walls, 1200) | {"shared batchgen on": computed}
    return report.summarize(runs_of(walls, prefill), {"shared": shared}, 128, 300)


def test_ratios_are_medians_over_rounds_and_the_share_counts_whole_pages(monkeypatch):
    summary = summary_of(monkeypatch, WALLS, computed=432)
    ratios = {name: (r["median"], r["min"], r["max"]) for name, r in summary["ratios"].items()}
    assert ratios["shared: batchgen off / on"] == (3.0, 2.0, 3.2)  # 3.0, 3.2, 2.0
    assert ratios["shared: vLLM off / on"] == (3.0, 2.0, 3.0)
    assert ratios["caching on: vLLM / batchgen"] == (1.2, 0.7058823529411765, 1.8)
    assert ratios["caching off: vLLM / batchgen"] == (1.125, 1.0588235294117647, 1.2)
    assert "unique: vLLM off / on" not in ratios
    # 4 lines of 300 tokens sharing 300, pages of 128: 3 lines skip 2 pages each
    assert (summary["prompt_tokens"], summary["unique_share"]) == (1200, 1200 - 3 * 256)
    assert summary["ceiling"] == 12.0 / 10.0
    cell = summary["cells"]["shared batchgen on"]
    assert (cell["wall_s"], cell["wall_min"], cell["wall_max"], cell["cpu_s"]) == (10, 10, 17, 5)


def test_every_goal_is_judged_and_under_the_ceiling_the_ratio_off_is_the_bar(monkeypatch):
    report = script_module(monkeypatch, "prefix_report")
    goals = report.verdicts(summary_of(monkeypatch, WALLS, computed=432))
    assert [(g["goal"], g["figures"], g["verdict"]) for g in goals] == [
        (
            "caching on computes only the unique share",
            "432 prefill tokens, unique share 432",
            "met",
        ),
        ("shared: caching speeds batchgen >= vLLM", "3.00x against vLLM's 3.00x", "met"),
        (
            "caching on: >= batchgen's ratio to vLLM off",
            "1.20x against 1.12x off (ceiling 1.20x < 1.25x)",
            "met",
        ),
        ("unique: caching on and off within 2%", "0.990x", "met"),
    ]
    slower = WALLS | {"shared vllm on": [40.0, 40.0, 40.0], "unique batchgen on": [21.0] * 3}
    goals = report.verdicts(summary_of(monkeypatch, slower, computed=433))
    assert [(g["figures"], g["verdict"]) for g in goals] == [
        ("433 prefill tokens, unique share 432", "missed"),
        ("3.00x against vLLM's 0.90x", "met"),
        ("4.00x (ceiling 4.00x)", "met"),
        ("0.952x", "missed"),
    ]
    assert goals[2]["goal"] == "caching on: >= 1.25x vLLM"


def test_the_tables_show_every_cell_ratio_comparison_and_verdict(monkeypatch):
    report = script_module(monkeypatch, "prefix_report")
    summary = summary_of(monkeypatch, WALLS, computed=432)
    tokens = {"batchgen on vs vLLM on": dict(requests=4, equal=3, near_tie=1, differing=0)}
    console = Console(width=200, record=True)
    for table in report.render(summary, tokens, report.verdicts(summary), markdown=True):
        console.print(table)
    lines = console.export_text().splitlines()
    assert "| shared batchgen on  |  10.00 | 10.00-17.00 |  5.00 |              432 |" in "\n".join(
        lines
    )
    assert any("| caching on: vLLM / batchgen  |  1.20x | 0.71-1.80 |" in line for line in lines)
    assert any(
        "| batchgen on vs vLLM on |        4 |     3 |        1 |      0 |" in ln for ln in lines
    )
    assert any("| unique: caching on and off within 2%" in line for line in lines)


def test_vllm_s_runner_job_turns_its_prefix_cache_on_and_fits_the_longest_line(
    monkeypatch, tmp_path
):
    job = script_module(monkeypatch, "vllm_job")
    monkeypatch.setattr(job, "vllm_preload", lambda: "")

    class Process:  # the runner process, ready at once and never started
        def __init__(self, argv, **kwargs):
            self.stdout = io.StringIO('{"ready": true}\n')

    monkeypatch.setattr(job.subprocess, "Popen", Process)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    mix = job.build_mixes(["static"], vocab_size=64, seed=0)[0]
    log = tmp_path / "vllm.log"
    job.VllmRunner(
        Path("python"), str(tmp_path), mix, 1, 128, log, max_model_len=600, prefix_caching=True
    )
    settings = json.loads((tmp_path / "vllm-job-static.json").read_text())
    assert settings["engine_args"] == {"enable_prefix_caching": True, "block_size": 128}
    assert settings["max_model_len"] == 600


def test_vllm_s_runner_empties_its_prefix_cache_or_says_it_could_not(monkeypatch):
    runner = script_module(monkeypatch, "vllm_runner")

    class Llm:
        def __init__(self, empties: bool):
            self.empties, self.resets = empties, 0

        def reset_prefix_cache(self) -> bool:
            self.resets += 1
            return self.empties

    llm = Llm(empties=True)
    runner.empty_prefix_cache(llm)
    assert llm.resets == 1
    with pytest.raises(RuntimeError, match="vLLM could not empty its prefix cache"):
        runner.empty_prefix_cache(Llm(empties=False))
