"""pytest plugin: ``--kv-compare=off|log|raise`` runs the workers a test builds in KV compare mode.

Load it with ``-p batchgen.shadow.pytest_plugin`` (or through its ``pytest11`` entry
point). With a mode other than ``off``, a session-scoped autouse fixture sets,
for the whole session (so workers built in fixtures of any scope see it)::

    BATCHGEN_WORKER_KV_COMPARE       the mode
    BATCHGEN_WORKER_KV_COMPARE_LOG   --kv-compare-log (made absolute), else
                                     kv-divergences.jsonl in pytest's base temp dir

and, for the session, a ``Worker`` built without ``kv_ops`` gets its KV side from
the environment (``wiring.kv_ops_for``: the plugin is an edge, and parses it), so
it shadows the other KV path: ``raise`` fails the test at its first divergence,
``log`` appends it to the log; the terminal summary reports how many divergences
this session added. A worker given its ``kv_ops`` (``gated_worker``: an explicit
gate) keeps them. A ``--kv-compare-log`` no worker could write to (a directory)
is a usage error. ``off`` (the default) changes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from batchgen.kv.gate import GATE_FLAGS, GateError, gate_config

MODES = ("off", "log", "raise")
COMPARE_ENV = GATE_FLAGS["compare"][0]
LOG_ENV = GATE_FLAGS["compare_log"][0]
LOG_NAME = "kv-divergences.jsonl"
_LOG_PATH = pytest.StashKey[Path]()
# divergences the log held before the session (None: unreadable)
_EARLIER = pytest.StashKey["int | None"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("batchgen", "batchgen KV compare mode")
    group.addoption(
        "--kv-compare",
        choices=MODES,
        default="off",
        help=(
            "run every Worker a test builds (without an explicit kv_gate) in KV compare mode: "
            "log divergences, or raise on the first (default: off)"
        ),
    )
    group.addoption(
        "--kv-compare-log",
        metavar="PATH",
        default=None,
        help=f"divergence log of --kv-compare (default: {LOG_NAME} in pytest's base temp dir)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """A ``--kv-compare-log`` no worker could write to (empty, a directory, a path under a file, a
    file that is not a divergence log) is a usage error, not an error in every test that builds a
    worker."""
    option = config.getoption("kv_compare_log")
    if config.getoption("kv_compare") == "off" or option is None:
        return
    if not option:
        raise pytest.UsageError(
            "--kv-compare-log is empty; name a file (or leave the option out for "
            f"{LOG_NAME} in pytest's base temp dir)"
        )
    from compare import RecordError, check_log_file  # only sessions that log pay for the import

    try:
        gate_config({}, {"compare_log": option})
        check_log_file(option)
    except (GateError, RecordError) as error:
        raise pytest.UsageError(str(error)) from None


@pytest.fixture(scope="session", autouse=True)
def _batchgen_kv_compare(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Set the compare-mode variables for the whole session, before any other fixture of any scope
    builds a worker (restored after). Notes how many divergences the log held already, so the
    summary counts this session's own."""
    config = request.config
    mode = config.getoption("kv_compare")
    if mode == "off":
        yield
        return
    option = config.getoption("kv_compare_log")
    # a test may chdir
    log = Path(option).resolve() if option else tmp_path_factory.getbasetemp() / LOG_NAME
    config.stash[_LOG_PATH] = log
    # None when the log cannot be read: the tests run anyway
    config.stash[_EARLIER] = _num_divergences(log)
    # only sessions that compare pay for the engine's import (torch)
    from batchgen.engine.worker import Worker

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(COMPARE_ENV, mode)
        monkeypatch.setenv(LOG_ENV, str(log))
        monkeypatch.setattr(Worker, "__init__", _gated(Worker.__init__))
        yield


def _gated(init):
    """``Worker.__init__``, building a worker given no ``kv_ops`` with the KV side the
    environment's gate sets (its load failure policy over the engine config)."""
    from batchgen.shadow.wiring import gated_options

    def __init__(self, model, **options):
        if "kv_ops" not in options:
            options = gated_options(gate_config(os.environ), **options)
        init(self, model, **options)

    return __init__


def _num_divergences(log: Path) -> int | None:
    """Divergence records in ``log`` (0 when there is none yet); None when it cannot be read."""
    if not log.exists():
        return 0
    # only sessions that log pay for the import
    from compare import DivergenceRecord, RecordError, read_log

    try:
        return sum(isinstance(record, DivergenceRecord) for record in read_log(log).records)
    except RecordError:
        return None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Report how many divergences this session added to the compare log, and where it is."""
    log = config.stash.get(_LOG_PATH, None)
    if log is None or not log.exists():
        return
    now, earlier = _num_divergences(log), config.stash[_EARLIER]
    if now is None or earlier is None:
        terminalreporter.write_line(
            f"kv-compare: divergences go to {log}, which holds lines that are not records: "
            f"`batchgen report {log}` says which"
        )
        return
    terminalreporter.write_line(f"kv-compare: {now - earlier} divergences in {log}")
