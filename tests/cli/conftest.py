"""Shared by the command's tests: no ``BATCHGEN_WORKER_KV_*`` variable leaks in, and fixtures
more than one file uses."""

import os

import pytest
from injected_bugs import reversed_grants

from batchgen.cli import main
from batchgen.kv.gate import ENV_PREFIX


@pytest.fixture(autouse=True)
def no_gate_environment(monkeypatch):
    """Tests start from an environment without BATCHGEN_WORKER_KV_* (they set what they test)."""
    for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> tuple:
    """Two smoke runs in compare mode (legacy serving, plan shadowed): a clean log, and one with
    alloc divergences."""
    directory = tmp_path_factory.mktemp("logs")
    clean, buggy = directory / "clean.jsonl", directory / "buggy.jsonl"
    flags = [
        "run",
        "--workload",
        "smoke",
        "--kv-path",
        "legacy",
        "--kv-compare",
        "log",
        "--json",
        "--kv-compare-log",
    ]
    assert main([*flags, str(clean)]) == 0
    with pytest.MonkeyPatch.context() as monkeypatch:
        reversed_grants(monkeypatch)
        assert main([*flags, str(buggy)]) == 0
    return clean, buggy
