import os

import pytest

import batchgen.kv.legacy  # noqa: F401
import batchgen.kv.manager  # noqa: F401

# Imported here so the in-process pytester runs reuse these modules instead of re-importing them.
import batchgen.shadow.kv_compare  # noqa: F401
from batchgen.engine.worker import Worker  # noqa: F401
from batchgen.kv.gate import GATE_FLAGS
from batchgen.model.null_model import NullModel  # noqa: F401
from compare import DivergenceRecord, RunSummary, read_log

pytest_plugins = ["pytester"]

PLUGIN = ("-p", "batchgen.shadow.pytest_plugin")

BUGGY_WORKER_TEST = """
import batchgen.kv.manager as kv_manager
from batchgen.config import TINY_MODELS, CacheConfig
from batchgen.model.null_model import NullModel
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.plans import AllocPlan, PageGrant
from batchgen.shadow.wiring import kv_ops_for
from batchgen.state import Request
from batchgen.engine.worker import Worker


def reversed_grants(monkeypatch):
    correct = kv_manager.KVCacheManager.plan_allocation

    def plan_allocation(self, req):
        plan = correct(self, req)
        grants = tuple(PageGrant(g.uuid, g.new_page_ids[::-1]) for g in plan.grants)
        return AllocPlan(grants, plan.not_fitting)

    monkeypatch.setattr(kv_manager.KVCacheManager, "plan_allocation", plan_allocation)


def run(**gate):
    cache = CacheConfig(page_size=4, num_gpu_pages=16, num_host_pages=8)
    worker = Worker(NullModel(TINY_MODELS["tiny"]), cache_config=cache, kv_storage=False, **gate)
    worker.add_request(Request("r0", tuple(range(1, 10)), max_new_tokens=2))
    for _ in range(100):
        worker.step()
        if not worker.has_unfinished():
            break
    assert not worker.has_unfinished(), "unfinished after 100 steps"


def test_worker_with_a_buggy_manager(monkeypatch):
    reversed_grants(monkeypatch)
    run()


def test_worker_with_an_explicit_gate(monkeypatch):
    reversed_grants(monkeypatch)
    run(kv_ops=kv_ops_for(KvGateConfig()))
"""


@pytest.fixture(autouse=True)
def no_gate_environment(monkeypatch):
    """The inner sessions run in this process: start them without any gate variable set."""
    for env, _, _ in GATE_FLAGS.values():
        monkeypatch.delenv(env, raising=False)


@pytest.fixture
def buggy(pytester):
    pytester.makepyfile(test_buggy=BUGGY_WORKER_TEST)
    return pytester


def test_a_worker_with_a_buggy_manager_fails_under_raise(buggy):
    result = buggy.runpytest(*PLUGIN, "--kv-compare=raise", "-k", "buggy_manager")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*DivergenceError: alloc step 0: state divergence*"])


def test_a_worker_with_a_buggy_manager_passes_when_off(buggy):
    buggy.runpytest(*PLUGIN, "--kv-compare=off").assert_outcomes(passed=2)
    buggy.runpytest(*PLUGIN).assert_outcomes(passed=2)


def test_log_mode_passes_and_logs_the_divergence(buggy, tmp_path):
    log = tmp_path / "kv.jsonl"
    result = buggy.runpytest(*PLUGIN, "--kv-compare=log", f"--kv-compare-log={log}")
    result.assert_outcomes(passed=2)
    records = [r for r in read_log(log).records if isinstance(r, DivergenceRecord)]
    assert [(r.op, r.step, r.authoritative, r.shadow) for r in records] == [
        ("alloc", 0, "plan", "legacy")
    ]
    result.stdout.fnmatch_lines([f"kv-compare: 1 divergences in {log}"])


def test_a_worker_with_an_explicit_gate_keeps_it(buggy):
    buggy.runpytest(*PLUGIN, "--kv-compare=raise", "-k", "explicit_gate").assert_outcomes(passed=1)


MODULE_FIXTURE_TEST = (
    "import pytest\n"
    + BUGGY_WORKER_TEST
    + """

@pytest.fixture(scope="module")
def module_worker():
    cache = CacheConfig(page_size=4, num_gpu_pages=16, num_host_pages=8)
    return Worker(NullModel(TINY_MODELS["tiny"]), cache_config=cache, kv_storage=False)


def test_a_worker_from_a_module_fixture_is_compared(module_worker):
    assert module_worker.kv_compare is not None
"""
)


def test_a_worker_built_in_a_module_scoped_fixture_runs_in_compare_mode(pytester):
    pytester.makepyfile(test_module=MODULE_FIXTURE_TEST)
    pytester.runpytest(*PLUGIN, "--kv-compare=log", "-k", "module_fixture").assert_outcomes(
        passed=1
    )


def test_a_relative_log_path_holds_when_a_test_changes_directory(buggy, tmp_path):
    buggy.makepyfile(
        test_chdir="""
        from test_buggy import reversed_grants, run

        def test_in_another_directory(monkeypatch, tmp_path):
            monkeypatch.chdir(tmp_path)
            reversed_grants(monkeypatch)
            run()
    """
    )
    result = buggy.runpytest(*PLUGIN, "--kv-compare=log", "--kv-compare-log=rel.jsonl")
    result.assert_outcomes(passed=3)
    log = buggy.path / "rel.jsonl"
    assert sum(isinstance(r, DivergenceRecord) for r in read_log(log).records) == 2
    result.stdout.fnmatch_lines([f"kv-compare: 2 divergences in {log}"])


def test_the_summary_counts_this_sessions_divergences_only(buggy, tmp_path):
    log = tmp_path / "kv.jsonl"
    for _ in range(2):
        result = buggy.runpytest(*PLUGIN, "--kv-compare=log", f"--kv-compare-log={log}")
        result.stdout.fnmatch_lines([f"kv-compare: 1 divergences in {log}"])
    assert sum(isinstance(r, DivergenceRecord) for r in read_log(log).records) == 2


def test_a_log_with_lines_that_are_not_records_leaves_the_tests_alone_and_the_summary_says_so(
    buggy, tmp_path
):
    log = tmp_path / "kv.jsonl"
    summary = RunSummary(
        binding="kv",
        run_id="r",
        workload="smoke",
        seed=0,
        authoritative="plan",
        shadow="legacy",
        steps_compared={"alloc": 1},
        divergences={},
        harness_errors=0,
        compare_seconds=0.1,
        authoritative_seconds=0.1,
    )
    log.write_text(summary.model_dump_json() + '\n{"not": "a record"}\n')
    result = buggy.runpytest(*PLUGIN, "--kv-compare=log", f"--kv-compare-log={log}")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [f"kv-compare: divergences go to {log}, which holds lines that are not records*"]
    )


def test_the_gate_variables_are_restored_after_the_session(pytester):
    pytester.makepyfile(
        test_env="""
        import os

        def test_sees_the_mode():
            assert os.environ["BATCHGEN_WORKER_KV_COMPARE"] == "log"
    """
    )
    pytester.runpytest(*PLUGIN, "--kv-compare=log").assert_outcomes(passed=1)
    assert "BATCHGEN_WORKER_KV_COMPARE" not in os.environ


def test_an_unknown_mode_is_a_usage_error(pytester):
    result = pytester.runpytest(*PLUGIN, "--kv-compare=loud")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-compare: invalid choice: 'loud'*"])


@pytest.mark.parametrize("content", ["not a log\n", '{"not": "a record"}\n'], ids=["text", "json"])
def test_a_compare_log_that_is_no_log_is_a_usage_error_and_left_as_it_was(
    pytester, tmp_path, content
):
    log = tmp_path / "notes.txt"
    log.write_text(content)
    result = pytester.runpytest(*PLUGIN, "--kv-compare=log", f"--kv-compare-log={log}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"*{log}: not a divergence log (its first line is no record), so nothing is "
            "appended to it; name a new file or an existing log*"
        ]
    )
    assert log.read_text() == content


def test_an_empty_compare_log_option_is_a_usage_error(pytester):
    result = pytester.runpytest(*PLUGIN, "--kv-compare=log", "--kv-compare-log=")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-compare-log is empty; name a file*"])


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_a_compare_log_no_worker_could_write_is_a_usage_error(pytester, tmp_path, where):
    (tmp_path / "file").write_text("")
    log = tmp_path if where == "a directory" else tmp_path / "file" / "kv.jsonl"
    reason = (
        f"{tmp_path} is a directory"
        if where == "a directory"
        else f"{tmp_path / 'file'} is not a directory"
    )
    result = pytester.runpytest(*PLUGIN, "--kv-compare=raise", f"--kv-compare-log={log}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*--kv-compare-log='{log}' is invalid ({reason}); allowed: a file path*"]
    )
