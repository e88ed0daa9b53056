"""Prefix caching's switch and counters: ``BATCHGEN_WORKER_KV_PREFIX_CACHE`` and vLLM's
``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` (on for ``generate`` and
``batchgen.LLM``, the workload's for ``run``, ``sweep`` and ``explore``; an option beats the
variable), usage's ``prompt_tokens_details.cached_tokens``, and ``prefix_cache_queries`` /
``prefix_cache_hits`` in the summary and the metrics.

The batch file's prompts are token ids, so that pages are exact: on pages of 8 tokens, three
prompts share their first 20 tokens, two full pages (16 tokens) and a part of a third::

    a  SHARED + (30, 31, 32)    23 tokens  the first: nothing cached yet
    b  SHARED + (40, 41)        22 tokens  pages 0-1 from the cache: 16 cached tokens
    c  SHARED + (50,), n=3      21 tokens  each sample: pages 0-1 cached; usage counts the prompt
                                           once, with its first sample's 16 cached tokens
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchgen import LLM
from batchgen.cli import build_parser, main
from batchgen.cli.run_flags import prefix_caching_from_args
from batchgen.config import CacheConfig
from batchgen.kv.gate import ENV_PREFIX, GATE_FLAGS, GateError, KvGateConfig, gate_config
from batchgen.kv.plans import KvGeometry, KvPreState, KvSnapshot, ReleaseRequest, to_jsonable
from batchgen.shadow.wiring import KvDirection
from batchgen.sweep.matrix import cell_workload, sweep_cells, sweep_workloads
from batchgen.text.tiny_checkpoint import make_checkpoint
from batchgen.triage.rebuild import rebuild_target
from batchgen.validation.explore import explore
from compare import DivergenceRecord

ENV = "BATCHGEN_WORKER_KV_PREFIX_CACHE"
CACHE = CacheConfig(page_size=4, num_gpu_pages=16, num_host_pages=4)
SHARED = list(range(5, 25))  # 20 tokens: two full pages of 8 and 4 tokens of a third
PROMPTS = {"a": SHARED + [30, 31, 32], "b": SHARED + [40, 41], "c": SHARED + [50]}
# every sample of every line is looked up: 23 + 22 + 3 x 21 tokens, of which b's and each of c's
# samples' first two pages hit
QUERIES, HITS = 23 + 22 + 3 * 21, 16 + 3 * 16
POOLS = ["--page-size", "8", "--gpu-pages", "64", "--host-pages", "8", "--threads", "1"]
# a workload whose cache config leaves prefix caching off; b arrives after a's prompt is in pages
TWO = {
    "name": "two",
    "cache": {"page_size": 4, "num_gpu_pages": 16, "num_host_pages": 4, "watermark": 0.0},
    "requests": [
        {"uuid": "a", "prompt_ids": list(range(1, 11)), "max_new_tokens": 3},
        {"uuid": "b", "prompt_ids": [*range(1, 9), 20, 21], "max_new_tokens": 3, "arrival_step": 2},
    ],
}


@pytest.fixture(autouse=True)
def no_gate_environment(monkeypatch):
    """Tests start without BATCHGEN_WORKER_KV_* (they set what they test)."""
    for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-ckpt")


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "in.jsonl"
    lines = [
        {
            "custom_id": key,
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "prompt": prompt,
                "max_tokens": 4,
                "temperature": 0,
                "n": 3 if key == "c" else 1,
            },
        }
        for key, prompt in PROMPTS.items()
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def generate(capsys, checkpoint, batch_file, out, *flags) -> tuple[dict, dict]:
    """``generate`` of the batch file: its summary, and each line's body by custom_id."""
    argv = ["generate", "-i", str(batch_file), "-o", str(out), "--model", str(checkpoint)]
    assert main([*argv, *POOLS, "--json", *flags]) == 0
    summary = json.loads(capsys.readouterr().out)
    bodies = {}
    for text in out.read_text().splitlines():
        line = json.loads(text)
        bodies[line["custom_id"]] = line["response"]["body"]
    return summary, bodies


def cached_tokens(bodies: dict) -> dict[str, int]:
    return {
        key: body["usage"]["prompt_tokens_details"]["cached_tokens"] for key, body in bodies.items()
    }


def metric_values(path) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(path.read_text())
        for sample in family.samples
    }


# ---- the gate -----------------------------------------------------------------------------------
def test_the_variable_and_its_option_are_vllms_names():
    assert GATE_FLAGS["prefix_cache"] == (ENV, "--enable-prefix-caching", "on, off")


def test_the_variable_sets_the_gate_and_the_gate_sets_the_cache_config():
    on, off = gate_config({ENV: "on"}), gate_config({ENV: "off"})
    assert (on.prefix_cache, off.prefix_cache) == ("on", "off")
    assert on.cache_config(CACHE) == CACHE.model_copy(update={"enable_prefix_caching": True})
    cached = CACHE.model_copy(update={"enable_prefix_caching": True})
    assert off.cache_config(cached) == CACHE


def test_without_the_variable_the_cache_config_keeps_its_own():
    gate = gate_config({})
    cached = CACHE.model_copy(update={"enable_prefix_caching": True})
    assert gate.prefix_cache is None
    assert (gate.cache_config(CACHE), gate.cache_config(cached)) == (CACHE, cached)


def test_an_option_beats_the_variable():
    assert gate_config({ENV: "off"}, {"prefix_cache": "on"}).prefix_cache == "on"
    assert gate_config({ENV: "on"}, {"prefix_cache": "off"}).prefix_cache == "off"
    assert gate_config({ENV: "on"}, {"prefix_cache": None}).prefix_cache == "on"


@pytest.mark.parametrize(
    ("value", "hint"),
    [("yes", ""), ("of", "; did you mean 'off'?"), ("ON", "; did you mean 'on'?")],
)
def test_a_bad_value_names_the_variable_and_on_off(value, hint):
    with pytest.raises(GateError) as raised:
        gate_config({ENV: value})
    assert str(raised.value) == (
        f"{ENV}={value!r} is invalid (Input should be 'on' or 'off'); allowed: on, off{hint}"
    )


def test_a_misspelt_variable_is_refused_naming_the_right_one():
    with pytest.raises(GateError, match=f"did you mean {ENV}\\?"):
        gate_config({"BATCHGEN_WORKER_KV_PREFIX_CACHING": "on"})


# ---- the options --------------------------------------------------------------------------------
COMMANDS = {
    "run": ["run", "--workload", "smoke"],
    "generate": ["generate", "-i", "in.jsonl", "-o", "out.jsonl", "--model", "m"],
    "sweep": ["sweep"],
    "explore": ["explore"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], None), (["--enable-prefix-caching"], "on"), (["--no-enable-prefix-caching"], "off")],
)
def test_each_command_takes_the_pair(command, flags, expected):
    args = build_parser().parse_args([*COMMANDS[command], *flags])
    assert args.kv_prefix_cache == expected


def test_the_pair_together_is_refused(capsys):
    argv = [*COMMANDS["run"], "--enable-prefix-caching", "--no-enable-prefix-caching"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "batchgen: error: argument --no-enable-prefix-caching: not allowed with argument"
        " --enable-prefix-caching (see 'batchgen run --help')\n"
    )


@pytest.mark.parametrize(
    ("option", "variable", "expected"),
    [(None, None, None), (None, "on", True), ("off", "on", False), ("on", "off", True)],
)
def test_sweep_and_explore_read_the_option_over_the_variable(
    monkeypatch, option, variable, expected
):
    if variable is not None:
        monkeypatch.setenv(ENV, variable)
    assert prefix_caching_from_args(argparse.Namespace(kv_prefix_cache=option)) is expected


# ---- generate: usage, summary, metrics ----------------------------------------------------------
def test_generate_caches_by_default_and_counts_each_prompt_once(
    checkpoint, batch_file, tmp_path, capsys
):
    prom = tmp_path / "batchgen.prom"
    summary, bodies = generate(
        capsys, checkpoint, batch_file, tmp_path / "out.jsonl", "--metrics-file", str(prom)
    )
    assert cached_tokens(bodies) == {"a": 0, "b": 16, "c": 16}
    assert {key: body["usage"]["prompt_tokens"] for key, body in bodies.items()} == {
        "a": 23,
        "b": 22,
        "c": 21,
    }
    assert len(bodies["c"]["choices"]) == 3
    assert (summary["prefix_cache_queries"], summary["prefix_cache_hits"]) == (QUERIES, HITS)
    values, job = metric_values(prom), (("workload", "in.jsonl"),)
    assert values[("batchgen:prefix_cache_queries_total", job)] == QUERIES
    assert values[("batchgen:prefix_cache_hits_total", job)] == HITS


def test_generate_without_caching_reports_zero_and_writes_the_same_tokens(
    checkpoint, batch_file, tmp_path, capsys
):
    _, cached = generate(capsys, checkpoint, batch_file, tmp_path / "on.jsonl")
    summary, bodies = generate(
        capsys, checkpoint, batch_file, tmp_path / "off.jsonl", "--no-enable-prefix-caching"
    )
    assert cached_tokens(bodies) == {"a": 0, "b": 0, "c": 0}
    assert (summary["prefix_cache_queries"], summary["prefix_cache_hits"]) == (0, 0)
    for key, body in bodies.items():
        assert body["choices"] == cached[key]["choices"]
        assert body["usage"]["completion_tokens"] == cached[key]["usage"]["completion_tokens"]


def test_generate_takes_the_variable_and_the_option_beats_it(
    checkpoint, batch_file, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv(ENV, "off")
    _, off = generate(capsys, checkpoint, batch_file, tmp_path / "off.jsonl")
    _, on = generate(
        capsys, checkpoint, batch_file, tmp_path / "on.jsonl", "--enable-prefix-caching"
    )
    assert (cached_tokens(off), cached_tokens(on)) == (
        {"a": 0, "b": 0, "c": 0},
        {"a": 0, "b": 16, "c": 16},
    )


# ---- run: the workload's setting ----------------------------------------------------------------
@pytest.fixture
def two_workload(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "two.json").write_text(json.dumps(TWO))
    return "two.json"


def run_summary(capsys, *argv) -> dict:
    assert main(["run", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_run_keeps_the_workloads_setting_unless_told(two_workload, capsys, tmp_path):
    counted = ("prefix_cache_queries", "prefix_cache_hits")
    plain = run_summary(capsys, "--workload", two_workload)
    prom = tmp_path / "run.prom"
    cached = run_summary(
        capsys, "--workload", two_workload, "--enable-prefix-caching", "--metrics-file", str(prom)
    )
    # a: 10 tokens looked up, none cached; b: 10 looked up, its first two pages (8 tokens) cached
    assert [(s[counted[0]], s[counted[1]]) for s in (plain, cached)] == [(0, 0), (20, 8)]
    values, two = metric_values(prom), (("workload", "two"),)
    assert (
        values[("batchgen:prefix_cache_queries_total", two)],
        values[("batchgen:prefix_cache_hits_total", two)],
    ) == (20, 8)
    assert plain["tokens_generated"] == cached["tokens_generated"] == 6


def test_run_takes_the_variable(two_workload, capsys, monkeypatch):
    monkeypatch.setenv(ENV, "on")
    summary = run_summary(capsys, "--workload", two_workload)
    assert (summary["prefix_cache_queries"], summary["prefix_cache_hits"]) == (20, 8)


def test_the_shared_prefix_workload_caches_unless_turned_off(capsys):
    on = run_summary(capsys, "--workload", "shared-prefix", "--scale", "0.25")
    off = run_summary(
        capsys, "--workload", "shared-prefix", "--scale", "0.25", "--no-enable-prefix-caching"
    )
    assert on["prefix_cache_hits"] > 0
    assert (off["prefix_cache_queries"], off["prefix_cache_hits"]) == (0, 0)


# ---- batchgen.LLM -------------------------------------------------------------------------------
def llm(checkpoint, **options) -> LLM:
    return LLM(checkpoint, gpu_pages=64, host_pages=8, page_size=8, **options)


def test_llm_caches_by_default_and_says_what_each_prompt_took(checkpoint):
    cached, plain = llm(checkpoint), llm(checkpoint, enable_prefix_caching=False)
    prompts = [PROMPTS["a"], PROMPTS["b"]]
    with_cache, without = (m.generate(prompts) for m in (cached, plain))
    assert [r.num_cached_tokens for r in with_cache] == [0, 16]
    assert [r.num_cached_tokens for r in without] == [0, 0]
    assert [r.completions for r in with_cache] == [r.completions for r in without]


def test_llm_takes_the_variable_and_its_argument_beats_it(checkpoint, monkeypatch):
    monkeypatch.setenv(ENV, "off")
    assert not llm(checkpoint).worker.cache_config.enable_prefix_caching
    assert llm(checkpoint, enable_prefix_caching=True).worker.cache_config.enable_prefix_caching
    gate = KvGateConfig(prefix_cache="off")
    assert not llm(checkpoint, kv_gate=gate).worker.cache_config.enable_prefix_caching


def test_llm_refuses_a_switch_that_is_not_a_bool(checkpoint):
    with pytest.raises(ValueError) as raised:
        llm(checkpoint, enable_prefix_caching="no")
    assert str(raised.value) == (
        "enable_prefix_caching='no'; allowed: True, False, or None (the gate's, else on)"
    )


# ---- sweep, explore, replay ---------------------------------------------------------------------
def test_a_sweep_cell_sets_its_workloads_caching_and_keeps_its_id_without_it():
    plan = (KvDirection("plan", "legacy"),)
    workloads = sweep_workloads(["smoke"])
    (plain,) = sweep_cells(workloads, (0,), (None,), plan)
    (cached,) = sweep_cells(workloads, (0,), (None,), plan, prefix_caching=True)
    assert not cell_workload(plain, 512).cache.enable_prefix_caching
    assert cell_workload(cached, 512).cache.enable_prefix_caching
    # the id smoke seed 0 plan/legacy had before the switch existed; the switch makes another run
    assert (plain.run_id, cached.run_id) == ("smoke-5b8ec460f28b698e", "smoke-c6b4cbdf782de8f3")


def test_explore_gives_every_candidate_the_switch():
    result = explore(seed=0, max_runs=1, prefix_caching=True)
    assert [kept.workload.cache.enable_prefix_caching for kept in result.kept] == [True]


def test_a_replayed_op_rebuilds_the_recorded_caching():
    geometry = KvGeometry(
        num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype_size=4, num_gpu_pages=16,
        num_host_pages=4, watermark=0.0, max_num_seqs=8, max_load_retries=1, prefix_caching=True,
    )  # fmt: skip
    snapshot = KvSnapshot(step=3, geometry=geometry, num_free_gpu_pages=16, num_free_host_pages=4)
    replay = {
        "op": "release",
        "request_type": "ReleaseRequest",
        "request": to_jsonable(ReleaseRequest(snapshot, ())),
        "pre_state": to_jsonable(KvPreState(snapshot, ())),
        "kv_path": "plan",
        "shadow_path": "legacy",
    }
    record = DivergenceRecord(
        binding="kv", run_id="r", workload="w", seed=0, step=3, op="release",
        authoritative="plan", shadow="legacy", kind="state", field_paths=[], diff={},
        exception=None, replay=replay, created_at=0.0,
    )  # fmt: skip
    assert rebuild_target(record).cache_config.enable_prefix_caching
