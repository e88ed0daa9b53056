"""pytest plugin: ``--kv-compare=off|log|raise`` runs the workers a test builds in KV compare mode.

Load it with ``-p batchgen.pytest_plugin`` (or through its ``pytest11`` entry
point). With a mode other than ``off``, an autouse fixture sets, for each test::

    BATCHGEN_WORKER_KV_COMPARE       the mode
    BATCHGEN_WORKER_KV_COMPARE_LOG   --kv-compare-log, else kv-divergences.jsonl in
                                     pytest's base temp dir (one log per session)

and a ``Worker`` built without an explicit ``kv_gate`` parses the environment,
so it shadows the other KV path: ``raise`` fails the test at its first
divergence, ``log`` appends it to the log, whose count the terminal summary
reports. A worker given an explicit ``kv_gate`` keeps it. ``off`` (the default)
changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.worker.kv_gate import GATE_FLAGS

MODES = ("off", "log", "raise")
COMPARE_ENV = GATE_FLAGS["compare"][0]
LOG_ENV = GATE_FLAGS["compare_log"][0]
LOG_NAME = "kv-divergences.jsonl"
_LOG_PATH = pytest.StashKey[Path]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("batchgen", "batchgen KV compare mode")
    group.addoption("--kv-compare", choices=MODES, default="off",
                    help="run every Worker a test builds (without an explicit kv_gate) in KV compare mode: "
                         "log divergences, or raise on the first (default: off)")
    group.addoption("--kv-compare-log", metavar="PATH", default=None,
                    help=f"divergence log of --kv-compare (default: {LOG_NAME} in pytest's base temp dir)")


@pytest.fixture(autouse=True)
def _batchgen_kv_compare(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """Set the compare-mode variables for the test (monkeypatch restores them after)."""
    config = request.config
    mode = config.getoption("kv_compare")
    if mode == "off":
        return
    if _LOG_PATH not in config.stash:
        option = config.getoption("kv_compare_log")
        config.stash[_LOG_PATH] = Path(option) if option else tmp_path_factory.getbasetemp() / LOG_NAME
    monkeypatch.setenv(COMPARE_ENV, mode)
    monkeypatch.setenv(LOG_ENV, str(config.stash[_LOG_PATH]))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Report how many divergences the compare log holds, and where it is."""
    log = config.stash.get(_LOG_PATH, None)
    if log is None or not log.exists():
        return
    from compare import DivergenceRecord, read_log  # only sessions that logged pay for the import

    records = read_log(log).records
    num_divergences = sum(isinstance(record, DivergenceRecord) for record in records)
    terminalreporter.write_line(f"kv-compare: {num_divergences} divergences in {log}")
