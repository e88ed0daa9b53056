import ast
import dataclasses
import importlib.util
import json
import warnings

import pytest
from injected_bugs import prefix_bug, reversed_grants

import batchgen.kv.manager as kv_manager
from batchgen.config import TINY_MODELS
from batchgen.engine.faults import FaultInjector, FaultSpec
from batchgen.engine.runner import run_workload
from batchgen.engine.workloads import builtin_workload, load_workload
from batchgen.exit_codes import Terminated
from batchgen.kv.gate import KvGateConfig
from batchgen.kv.plans import Destination, EvictionPlan, PollAction, Victim
from batchgen.model.null_model import NullModel
from batchgen.shadow.wiring import gated_worker
from batchgen.triage.minimize import NotReproduced, minimize_divergence, recorded_workload
from batchgen.triage.minimize_search import DivergenceSignature
from batchgen.triage.regression import write_regression, write_regression_into
from compare import DivergenceError, DivergenceRecord, read_log

Manager = kv_manager.KVCacheManager


def inject_evict_bug(monkeypatch):
    """Victims are dropped for recompute although the host has room: needs memory pressure."""
    correct = Manager.plan_eviction
    monkeypatch.setattr(
        Manager,
        "plan_eviction",
        lambda self, req: EvictionPlan(
            tuple(
                Victim(v.uuid, Destination.RECOMPUTE, v.gpu_page_ids, ())
                for v in correct(self, req).victims
            )
        ),
    )


def inject_retry_bug(monkeypatch):
    """A failed load with retries left is recomputed instead of retried: needs a load to fail."""
    correct = Manager.plan_poll
    monkeypatch.setattr(
        Manager,
        "plan_poll",
        lambda self, req: dataclasses.replace(
            plan := correct(self, req),
            actions=tuple(
                PollAction.RECOMPUTE if action is PollAction.RETRY else action
                for action in plan.actions
            ),
        ),
    )


def null_worker(workload, *, kv_gate, shadow_path, faults=None):
    return gated_worker(
        NullModel(TINY_MODELS["tiny"]),
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_storage=False,
        kv_gate=kv_gate,
        shadow_path=shadow_path,
        faults=faults,
    )


def divergences(workload, log, *, source="smoke", faults=None, engine=None):
    """Run ``workload`` in compare mode (legacy authoritative), under ``faults`` (a SPEC) and
    ``engine``."""
    if engine is not None:
        workload = workload.model_copy(update={"engine": engine})
    worker = null_worker(
        workload,
        kv_gate=KvGateConfig(path="legacy", compare="log", compare_log=str(log)),
        shadow_path="plan",
        faults=FaultInjector(FaultSpec.parse(faults)) if faults else None,
    )
    run_workload(worker, workload, source=source)
    return (
        [r for r in read_log(log).records if isinstance(r, DivergenceRecord)]
        if log.exists()
        else []
    )


def first_divergence(tmp_path):
    return divergences(builtin_workload("smoke"), tmp_path / "kv.jsonl")[0]


def test_minimising_keeps_the_signature_with_fewer_requests_and_steps(tmp_path, monkeypatch):
    inject_evict_bug(monkeypatch)
    record = first_divergence(tmp_path)
    result = minimize_divergence(record, make_worker=null_worker)
    smoke = {r.uuid: r for r in builtin_workload("smoke").requests}
    minimal = result.workload.requests
    assert result.signature == DivergenceSignature.of(record) and result.signature.op == "evict"
    assert [(r.uuid, r.max_new_tokens, r.arrival_step) for r in minimal] == [
        ("smoke-r0", 6, 0),
        ("smoke-r2", 4, 2),
        ("smoke-r3", 3, 3),
    ]
    assert all(
        r.max_new_tokens <= smoke[r.uuid].max_new_tokens
        and r.arrival_step <= smoke[r.uuid].arrival_step
        for r in minimal
    )
    assert sum(r.max_new_tokens for r in minimal) < sum(
        smoke[r.uuid].max_new_tokens for r in minimal
    )
    assert (result.workload.name, result.kv_path, result.shadow_path) == (
        "smoke-min",
        "legacy",
        "plan",
    )
    assert (result.num_tests, result.stopped_by) == (65, None)
    again = divergences(result.workload, tmp_path / "again.jsonl")
    assert result.signature in {DivergenceSignature.of(r) for r in again}


def big_vocabulary_worker(workload, *, kv_gate, shadow_path, faults=None):
    """A null-model worker whose model has a 32000-token vocabulary (a checkpoint's, not the tiny
    model's 512)."""
    config = TINY_MODELS["tiny"].model_copy(update={"vocab_size": 32000})
    return gated_worker(
        NullModel(config),
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_storage=False,
        kv_gate=kv_gate,
        shadow_path=shadow_path,
        faults=faults,
    )


@pytest.mark.parametrize("source", ["smoke", "file"])
def test_minimises_a_run_whose_model_had_another_vocabulary_on_the_tiny_model(
    tmp_path, monkeypatch, source
):
    reversed_grants(monkeypatch)
    workload = builtin_workload("smoke", vocab_size=32000)
    if source == "file":  # token ids the tiny model would refuse
        workload = workload.model_copy(
            update={
                "requests": [
                    r.model_copy(
                        update={"prompt_ids": [1000 + token % 1000 for token in r.prompt_ids]}
                    )
                    for r in workload.requests
                ]
            }
        )
        path = tmp_path / "big.json"
        path.write_text(workload.model_dump_json())
        source = str(path)
    log = tmp_path / "kv.jsonl"
    worker = big_vocabulary_worker(
        workload,
        kv_gate=KvGateConfig(path="legacy", compare="log", compare_log=str(log)),
        shadow_path="plan",
    )
    run_workload(worker, workload, source=source)
    record = next(r for r in read_log(log).records if isinstance(r, DivergenceRecord))
    assert record.replay["vocab_size"] == 32000
    reloaded = recorded_workload(record)
    shape = [
        (r.uuid, len(r.prompt_ids), r.max_new_tokens, r.arrival_step) for r in workload.requests
    ]
    assert [
        (r.uuid, len(r.prompt_ids), r.max_new_tokens, r.arrival_step) for r in reloaded.requests
    ] == shape
    assert all(
        0 < token < TINY_MODELS["tiny"].vocab_size
        for r in reloaded.requests
        for token in r.prompt_ids
    )
    result = minimize_divergence(record, make_worker=null_worker)  # the tiny model's vocabulary
    assert result.signature == DivergenceSignature.of(record)


def test_a_divergence_at_the_first_alloc_shrinks_to_one_request_of_one_token_on_the_tiny_model(
    tmp_path, monkeypatch
):
    reversed_grants(monkeypatch)
    result = minimize_divergence(first_divergence(tmp_path))  # the default worker: the tiny model
    [request] = result.workload.requests
    assert (request.max_new_tokens, request.arrival_step) == (1, 0)
    assert result.signature.field_paths == (
        "pools.gpu[*].page_ids[*]",
        "requests[*].gpu_page_ids[*]",
    )


def test_the_written_regression_test_fails_until_the_bug_is_fixed(tmp_path, monkeypatch):
    reversed_grants(monkeypatch)
    result = minimize_divergence(first_divergence(tmp_path), make_worker=null_worker)
    workload_path = tmp_path / "regressions" / "workloads" / f"{result.signature.slug}.json"
    test_path = tmp_path / "regressions" / "tests" / f"test_kv_{result.signature.slug}.py"
    write_regression(result, workload_path, test_path)

    assert load_workload(str(workload_path)) == result.workload
    source = test_path.read_text()
    tree = ast.parse(source)
    name = f"test_no_{result.signature.slug}_divergence"
    assert [f.name for f in tree.body if isinstance(f, ast.FunctionDef)] == [name]
    assert f'Path(__file__).parent / "../workloads/{result.signature.slug}.json"' in source
    spec = importlib.util.spec_from_file_location("generated_regression", test_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(DivergenceError, match="alloc step 0: state divergence"):
        getattr(module, name)(tmp_path)
    monkeypatch.undo()
    getattr(module, name)(tmp_path)


def test_minimize_reports_each_candidate_and_the_smallest_that_diverged(tmp_path, monkeypatch):
    reversed_grants(monkeypatch)
    record = first_divergence(tmp_path)
    calls = []
    result = minimize_divergence(
        record, make_worker=null_worker, on_test=lambda *call: calls.append(call)
    )
    assert [num_tests for num_tests, _ in calls] == list(range(1, result.num_tests + 1))
    # the full workload diverges first
    assert calls[0][1] == len(recorded_workload(record).requests)
    smallest = [smallest for _, smallest in calls]
    assert smallest == sorted(smallest, reverse=True) and smallest[-1] == len(
        result.workload.requests
    )


def test_a_regression_with_the_same_signature_from_another_direction_gets_its_own_files(
    tmp_path, monkeypatch
):
    reversed_grants(monkeypatch)
    result = minimize_divergence(first_divergence(tmp_path), make_worker=null_worker)
    out_dir, slug = tmp_path / "minimized", result.signature.slug
    assert write_regression_into(out_dir, result) == (
        out_dir / f"{slug}.json",
        out_dir / f"test_kv_{slug}.py",
    )
    first = {path.name: path.read_text() for path in out_dir.iterdir()}
    assert write_regression_into(out_dir, result) == (
        out_dir / f"{slug}.json",
        out_dir / f"test_kv_{slug}.py",
    )
    # the same one again: rewritten
    assert {path.name: path.read_text() for path in out_dir.iterdir()} == first
    other = dataclasses.replace(result, kv_path=result.shadow_path, shadow_path=result.kv_path)
    assert write_regression_into(out_dir, other) == (
        out_dir / f"{slug}_2.json",
        out_dir / f"test_kv_{slug}_2.py",
    )
    assert {
        path.name: path.read_text() for path in out_dir.iterdir() if path.name in first
    } == first
    assert f'"{slug}_2.json"' in (out_dir / f"test_kv_{slug}_2.py").read_text()
    assert (
        f"KvGateConfig(path={json.dumps(other.kv_path)},"
        in (out_dir / f"test_kv_{slug}_2.py").read_text()
    )


def generated_test(test_path, module_name):
    """The one test function of a regression test file ``write_regression`` wrote, imported as
    ``module_name``."""
    spec = importlib.util.spec_from_file_location(module_name, test_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    [test] = [getattr(module, name) for name in dir(module) if name.startswith("test_no_")]
    return test


def test_the_written_regression_test_compares_only_its_op_so_another_ops_bug_does_not_fail_it(
    tmp_path, monkeypatch
):
    reversed_grants(monkeypatch)  # an alloc bug, which the evict regression test is not about
    with pytest.MonkeyPatch.context() as evict_bug:
        inject_evict_bug(evict_bug)
        record = next(
            r
            for r in divergences(builtin_workload("smoke"), tmp_path / "kv.jsonl")
            if r.op == "evict"
        )
        result = minimize_divergence(record, make_worker=null_worker)
        write_regression(result, tmp_path / "min.json", tmp_path / "test_min.py")
        test = generated_test(tmp_path / "test_min.py", "generated_evict_regression")
        with pytest.raises(DivergenceError, match="evict step"):
            test(tmp_path)
    test(tmp_path)  # the evict bug is fixed; the alloc bug is still there


def test_a_record_that_does_not_reproduce_is_refused(tmp_path, monkeypatch):
    reversed_grants(monkeypatch)
    record = first_divergence(tmp_path)
    monkeypatch.undo()
    with pytest.raises(NotReproduced, match="shows no state divergence at pools.gpu"):
        minimize_divergence(record, make_worker=null_worker)


def test_minimising_stops_at_the_test_budget_with_the_smallest_diverging_workload_so_far(
    tmp_path, monkeypatch
):
    inject_evict_bug(monkeypatch)
    record = first_divergence(tmp_path)
    with warnings.catch_warnings():
        # no raw UserWarning (ddmin's own budget) reaches the command's user
        warnings.simplefilter("error")
        result = minimize_divergence(record, make_worker=null_worker, max_tests=3)
    assert (result.num_tests, result.stopped_by) == (3, "max_tests")
    assert result.signature == DivergenceSignature.of(record)
    assert result.workload.name == "smoke-min"
    # the first half
    assert [r.uuid for r in result.workload.requests] == [f"smoke-r{i}" for i in range(4)]


def test_a_workload_file_is_reloaded_from_its_path(tmp_path, monkeypatch):
    reversed_grants(monkeypatch)
    source = tmp_path / "two.json"
    two = builtin_workload("smoke").model_copy(update={"name": "two"})
    two = two.model_copy(update={"requests": two.requests[:2]})
    source.write_text(two.model_dump_json())
    record = divergences(two, tmp_path / "kv.jsonl", source=str(source))[0]
    result = minimize_divergence(record, make_worker=null_worker)
    assert result.workload.name == "two-min" and len(result.workload.requests) == 1


def shared_prefix_divergence(tmp_path, monkeypatch, workload=None, source="shared-prefix"):
    """The first divergence of ``workload`` (shared-prefix's) with the plan's new pages handed out
    over the cache entries it shares: a migrate invalid_plan, which needs prefix caching."""
    prefix_bug("take_new").inject(monkeypatch)
    workload = workload or builtin_workload("shared-prefix")
    return divergences(workload, tmp_path / "kv.jsonl", source=source)[0]


def test_a_prefix_caching_divergence_shrinks_to_a_workload_with_caching_on(tmp_path, monkeypatch):
    record = shared_prefix_divergence(tmp_path, monkeypatch)
    result = minimize_divergence(record, make_worker=null_worker)
    assert result.signature == DivergenceSignature("migrate", "invalid_plan", ())
    assert [r.uuid for r in result.workload.requests] == [
        "shared-prefix-r1",
        "shared-prefix-r2",
        "shared-prefix-r3",
        "shared-prefix-r4",
        "shared-prefix-r12-1",
        "shared-prefix-r13",
        "shared-prefix-r14",
        "shared-prefix-r15",
    ]
    assert (result.num_tests, result.stopped_by) == (298, None)
    assert result.workload.cache.enable_prefix_caching
    again = divergences(result.workload, tmp_path / "again.jsonl", source="shared-prefix")
    assert result.signature in {DivergenceSignature.of(r) for r in again}
    cache = result.workload.cache.model_copy(update={"enable_prefix_caching": False})
    uncached = result.workload.model_copy(update={"cache": cache})
    assert divergences(uncached, tmp_path / "uncached.jsonl", source="shared-prefix") == []


def test_a_run_whose_prefix_caching_a_flag_turned_on_is_rerun_with_it_on(tmp_path, monkeypatch):
    """The workload file has caching off; the run (a gate flag) had it on, as its geometry says."""
    workload = builtin_workload("shared-prefix")
    source = tmp_path / "uncached.json"
    cache = workload.cache.model_copy(update={"enable_prefix_caching": False})
    source.write_text(workload.model_copy(update={"cache": cache}).model_dump_json())
    record = shared_prefix_divergence(tmp_path, monkeypatch, workload, source=str(source))
    assert record.replay["request"]["snapshot"]["geometry"]["prefix_caching"]
    # the whole workload first: it diverges, then the budget is spent
    result = minimize_divergence(record, make_worker=null_worker, max_tests=1)
    assert (result.stopped_by, len(result.workload.requests)) == ("max_tests", 60)
    assert result.workload.cache.enable_prefix_caching


def test_a_divergence_that_needs_faults_and_an_engine_override_is_minimized_under_both(
    tmp_path, monkeypatch
):
    inject_retry_bug(monkeypatch)
    source = tmp_path / "pressure.json"
    workload = (
        builtin_workload("smoke")
        .with_cache(num_host_pages=8)
        .model_copy(update={"name": "pressure"})
    )
    source.write_text(workload.model_dump_json())
    engine = workload.engine.model_copy(update={"max_load_retries": 2})
    assert not divergences(
        workload, tmp_path / "no-faults.jsonl", source=str(source), engine=engine
    )
    [record, *_] = divergences(
        workload, tmp_path / "kv.jsonl", source=str(source), faults="load_fail=1", engine=engine
    )
    spec = FaultSpec.parse("load_fail=1").to_spec()
    assert (record.op, record.replay["faults"], record.replay["engine"]["max_load_retries"]) == (
        "poll",
        spec,
        2,
    )

    result = minimize_divergence(record, make_worker=null_worker)
    assert result.faults == spec and result.workload.engine.max_load_retries == 2
    assert [(r.uuid, r.max_new_tokens, r.arrival_step) for r in result.workload.requests] == [
        ("smoke-r0", 10, 0),
        ("smoke-r1", 10, 0),
        ("smoke-r7", 6, 4),
    ]
    write_regression(result, tmp_path / "min.json", tmp_path / "test_min.py")
    assert f"FAULTS = {json.dumps(spec)}" in (tmp_path / "test_min.py").read_text()
    test = generated_test(tmp_path / "test_min.py", "generated_fault_regression")
    with pytest.raises(DivergenceError, match="poll step"):
        test(tmp_path)
    monkeypatch.undo()
    test(tmp_path)


def test_a_divergence_after_a_long_load_timeout_reproduces_past_the_candidates_usual_step_limit(
    tmp_path, monkeypatch
):
    inject_retry_bug(monkeypatch)
    workload = builtin_workload("smoke")
    # hung loads fail after 1000 steps
    engine = workload.engine.model_copy(update={"load_timeout_steps": 1000})
    [record, *_] = divergences(
        workload, tmp_path / "kv.jsonl", faults="seed=1,load_hang=1", engine=engine
    )
    assert record.op == "poll" and record.step > 1000
    result = minimize_divergence(record, make_worker=null_worker)
    assert result.signature == DivergenceSignature.of(record)
    assert [(r.uuid, r.max_new_tokens, r.arrival_step) for r in result.workload.requests] == [
        ("smoke-r1", 6, 1),
        ("smoke-r2", 5, 2),
        ("smoke-r3", 4, 3),
        ("smoke-r5", 2, 5),
    ]


def test_a_fault_spec_reads_back_from_its_spec_string():
    spec = FaultSpec.parse(
        "seed=7,load_fail=0.25,abort=0.5,abort_phases=waiting+swapped,store_delay_ms=3"
    )
    assert FaultSpec.parse(spec.to_spec()) == spec
    assert FaultSpec.parse(FaultSpec().to_spec()) == FaultSpec()


def test_the_signature_wildcards_ids_and_indexes():
    record = DivergenceRecord(
        binding="kv",
        run_id="r",
        workload="smoke",
        seed=0,
        step=3,
        op="alloc",
        authoritative="legacy",
        shadow="plan",
        kind="state",
        field_paths=[
            "requests[r2].gpu_page_ids[3]",
            "pools.gpu[0].page_ids[1]",
            "requests[r1].gpu_page_ids[0]",
        ],
        diff={},
        exception=None,
        replay={},
        created_at=0.0,
    )
    signature = DivergenceSignature.of(record)
    assert signature.field_paths == ("pools.gpu[*].page_ids[*]", "requests[*].gpu_page_ids[*]")
    assert signature.slug.startswith("alloc_state_") and signature.slug.isidentifier()


def interrupt_at(num_tests, interrupt):
    """An ``on_test`` that raises ``interrupt`` (Ctrl-C's KeyboardInterrupt, SIGTERM's Terminated)
    once the ``num_tests``-th candidate has run."""

    def on_test(done, smallest):
        if done == num_tests:
            raise interrupt

    return on_test


@pytest.mark.parametrize(
    "interrupt", [KeyboardInterrupt(), Terminated()], ids=["ctrl-c", "sigterm"]
)
def test_an_interrupt_hands_over_the_smallest_diverging_workload_so_far_then_propagates(
    tmp_path, monkeypatch, interrupt
):
    inject_evict_bug(monkeypatch)
    record = first_divergence(tmp_path)
    handed = []
    with pytest.raises(type(interrupt)) as raised:
        minimize_divergence(
            record,
            make_worker=null_worker,
            on_test=interrupt_at(20, interrupt),
            on_interrupt=handed.append,
        )
    assert raised.value is interrupt
    [result] = handed
    assert (result.num_tests, result.stopped_by, result.workload.name) == (
        20,
        "interrupted",
        "smoke-min",
    )
    assert result.signature == DivergenceSignature.of(record)
    # the step pass had begun on the three requests the finished search keeps (6, 4 and 3 new
    # tokens)
    assert [(r.uuid, r.max_new_tokens, r.arrival_step) for r in result.workload.requests] == [
        ("smoke-r0", 10, 0),
        ("smoke-r2", 10, 2),
        ("smoke-r3", 4, 3),
    ]


def test_the_smallest_diverging_workload_has_the_fewest_requests_then_the_fewest_step_units(
    tmp_path, monkeypatch
):
    inject_evict_bug(monkeypatch)
    record = first_divergence(tmp_path)
    handed = []
    for num_tests in (1, 2, 16, 20, 65):
        with pytest.raises(KeyboardInterrupt):
            minimize_divergence(
                record,
                make_worker=null_worker,
                on_test=interrupt_at(num_tests, KeyboardInterrupt()),
                on_interrupt=handed.append,
            )
    sizes = [
        (
            len(r.workload.requests),
            sum(r.max_new_tokens - 1 + r.arrival_step for r in r.workload.requests),
        )
        for r in handed
    ]
    # step units: new tokens above 1, arrival steps
    assert sizes == [(8, 124), (4, 49), (3, 35), (3, 26), (3, 15)]
    finished = minimize_divergence(record, make_worker=null_worker)
    # its last candidate: the result
    assert handed[-1] == dataclasses.replace(finished, stopped_by="interrupted")


def test_an_interrupt_before_any_candidate_diverged_hands_over_nothing(tmp_path, monkeypatch):
    inject_evict_bug(monkeypatch)
    record = first_divergence(tmp_path)

    def interrupted_worker(workload, **kwargs):
        raise KeyboardInterrupt

    handed = []
    with pytest.raises(KeyboardInterrupt):
        minimize_divergence(record, make_worker=interrupted_worker, on_interrupt=handed.append)
    assert handed == []


def test_a_budget_the_search_needs_exactly_lets_it_finish(tmp_path, monkeypatch):
    inject_evict_bug(monkeypatch)
    record = first_divergence(tmp_path)
    finished = minimize_divergence(record, make_worker=null_worker)
    assert (
        minimize_divergence(record, make_worker=null_worker, max_tests=finished.num_tests)
        == finished
    )
    short = minimize_divergence(record, make_worker=null_worker, max_tests=finished.num_tests - 1)
    assert (short.num_tests, short.stopped_by) == (finished.num_tests - 1, "max_tests")
