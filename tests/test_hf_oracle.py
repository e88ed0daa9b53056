"""The HF oracle of ``batchgen validate``: the tiny model's greedy tokens under KV pressure against
HF transformers running the same weights."""

import importlib.util
import re

import pytest
from test_validation import one_json_object, pressure_workload, use_workloads

import batchgen.engine.worker
from batchgen.cli import main
from batchgen.kv.manager import KVCacheManager
from batchgen.model.elementwise import RotaryEmbedding
from batchgen.validation import hf_oracle
from batchgen.validation.hf_oracle import check_against_hf

TOLERANCE = 1e-4  # float32's


def test_the_tiny_models_tokens_under_eviction_equal_hf_transformers():
    verdict = check_against_hf("cpu", "float32", TOLERANCE)
    assert verdict.failures == ()
    found = re.fullmatch(
        r"HF oracle: 4 requests, (\d+) evictions: tokens equal HF transformers", verdict.line
    )
    assert found and int(found[1]) > 0, verdict.line


def swap_k_and_v(monkeypatch) -> None:
    """A layout bug every engine run shares, the pressure-free reference included: K and V
    written into each other's place in the pages."""
    real_write = batchgen.engine.worker.write_kvs
    monkeypatch.setattr(
        batchgen.engine.worker,
        "write_kvs",
        lambda pages, writes: real_write(pages, [(i, s, kv.flip(1)) for i, s, kv in writes]),
    )


def rotate_keys_wrongly(monkeypatch) -> None:
    """A RoPE bug every engine run shares: the keys land in the pages rotated by frequencies 1.5x
    too high (so do the queries)."""
    real_init = RotaryEmbedding.__init__

    def init(self, config):
        real_init(self, config)
        self.inv_freq.mul_(1.5)

    monkeypatch.setattr(RotaryEmbedding, "__init__", init)


@pytest.mark.parametrize("bug", [swap_k_and_v, rotate_keys_wrongly], ids=lambda bug: bug.__name__)
def test_a_bug_in_the_kv_layout_fails_the_oracle_naming_each_request(bug, monkeypatch):
    bug(monkeypatch)
    verdict = check_against_hf("cpu", "float32", TOLERANCE)
    assert verdict.failures, verdict.line
    for failure in verdict.failures:
        assert re.fullmatch(
            r"HF oracle: hf-r\d: tokens \[[\d, ]+\] != HF transformers' \[[\d, ]+\] \(first "
            r"difference not a near-tie\)",
            failure,
        )
    assert verdict.line.endswith(f"{len(verdict.failures)} differ")


def test_an_engine_run_that_raises_is_a_named_failure_of_the_oracle(monkeypatch):
    def broken(self, req):
        raise RuntimeError("no plan today")

    monkeypatch.setattr(KVCacheManager, "plan_allocation", broken)
    verdict = check_against_hf("cpu", "float32", TOLERANCE)
    assert verdict.line == "HF oracle: the engine's run raised"
    assert verdict.failures == ("HF oracle: raised at step 0: RuntimeError: no plan today",)


def test_without_transformers_the_oracle_says_so_and_fails_nothing(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        hf_oracle.importlib.util,
        "find_spec",
        lambda name, *args: None if name == "transformers" else real_find_spec(name, *args),
    )
    verdict = check_against_hf("cpu", "float32", TOLERANCE)
    assert verdict == hf_oracle.OracleVerdict("HF oracle: skipped (transformers is not installed)")


def test_validate_runs_the_oracle_and_reports_its_line(monkeypatch, tmp_path, capsys):
    use_workloads(monkeypatch, tmp_path, pressure_workload("pa", seed=1), pressure_workload("pb"))
    main(["validate", "--json", "--reports-dir", str(tmp_path / "reports")])
    report = one_json_object(capsys.readouterr().out)
    assert not [f for f in report["failures"] if f.startswith("HF oracle")], report["failures"]
    assert re.fullmatch(
        r"HF oracle: 4 requests, \d+ evictions: tokens equal HF transformers", report["hf_oracle"]
    )


def test_a_rope_bug_every_engine_run_shares_fails_validate_in_the_oracle_alone(
    monkeypatch, tmp_path, capsys
):
    use_workloads(monkeypatch, tmp_path, pressure_workload("pa", seed=1), pressure_workload("pb"))
    rotate_keys_wrongly(monkeypatch)
    assert main(["validate", "--json", "--reports-dir", str(tmp_path / "reports")]) == 1
    failures = one_json_object(capsys.readouterr().out)["failures"]
    assert any(failure.startswith("HF oracle: hf-r") for failure in failures), failures
    # the checks that compare engine runs with each other cannot see it
    assert not [f for f in failures if "divergence" in f or "reference" in f or "fresh" in f]
