"""Fault schedules: parsing, determinism, and what must hold under any schedule."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.faults import ABORT_PHASES, FaultInjector, FaultSpec, FaultSpecError
from batchgen.engine.runner import run_workload
from batchgen.engine.workloads import Workload, WorkloadRequest
from batchgen.kv.gate import KvGateConfig
from batchgen.model.loader import load_model
from batchgen.shadow.wiring import gated_worker
from batchgen.state import Phase
from batchgen.validation.output_check import compare_outputs

MODEL = load_model("tiny")


def small_workload(seed: int, num_requests: int) -> Workload:
    import random

    rng = random.Random(seed)
    requests = [
        WorkloadRequest(
            uuid=f"f{i}",
            prompt_ids=[rng.randrange(1, 512) for _ in range(rng.randint(2, 30))],
            max_new_tokens=rng.randint(1, 20),
            arrival_step=rng.randint(0, 4),
        )
        for i in range(num_requests)
    ]
    cache = CacheConfig(
        page_size=rng.choice([3, 4, 5]),
        num_gpu_pages=18,
        num_host_pages=rng.choice([4, 9, 30]),
        watermark=0.05,
    )
    return Workload(
        name=f"faults-{seed}",
        seed=seed,
        cache=cache,
        engine=EngineConfig(
            max_num_seqs=6, max_load_retries=rng.randint(0, 2), load_timeout_steps=3
        ),
        requests=requests,
    )


def run(
    workload: Workload,
    *,
    gate: KvGateConfig | None = None,
    spec: FaultSpec | None = None,
    tmp_path=None,
):
    injector = FaultInjector(spec) if spec is not None else None
    worker = gated_worker(
        MODEL,
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_gate=gate or KvGateConfig(),
        faults=injector,
    )
    return run_workload(worker, workload, check_integrity=True), injector


def test_parse_reads_every_key():
    spec = FaultSpec.parse(
        "seed=7, load_fail=0.1,load_fail_late=0.2,load_hang=0.3,slow_store=0.4,store_delay_ms=5,"
        "host_shrink=0.5,gpu_refuse=0.6,abort=0.7,abort_phases=swapped+loading"
    )
    assert spec == FaultSpec(
        seed=7,
        load_fail=0.1,
        load_fail_late=0.2,
        load_hang=0.3,
        slow_store=0.4,
        store_delay_ms=5.0,
        host_shrink=0.5,
        gpu_refuse=0.6,
        abort=0.7,
        abort_phases=("swapped", "loading"),
    )


@pytest.mark.parametrize(
    "spec, message",
    [
        ("load_fial=0.1", "KEY one of"),
        ("load_fail", "is not KEY=VALUE"),
        ("load_fail=abc", "load_fail='abc' is not a number"),
        ("load_fail=1.5", "must be a probability in [0, 1]"),
        ("seed=1.5", "seed='1.5' is not an integer"),
        ("abort_phases=running", "allowed: waiting+prefilling+decoding+swapped+loading"),
        ("store_delay_ms=-1", "must be in [0, 10000]"),
    ],
)
def test_parse_rejects_bad_specs_with_a_message_naming_the_part(spec, message):
    with pytest.raises(FaultSpecError) as error:
        FaultSpec.parse(spec)
    assert message in str(error.value)


def test_load_outcomes_depend_only_on_seed_request_and_attempt():
    a = FaultInjector(FaultSpec(seed=1, load_fail=0.3, load_fail_late=0.3, load_hang=0.3))
    b = FaultInjector(FaultSpec(seed=1, load_fail=0.3, load_fail_late=0.3, load_hang=0.3))
    outcomes = [a.load_outcome(f"r{i}", n) for i in range(20) for n in range(3)]
    assert outcomes == [b.load_outcome(f"r{i}", n) for i in range(20) for n in range(3)]
    assert {o for o, _ in outcomes} == {"ok", "load_fail", "load_fail_late", "hang"}


def test_a_stalled_load_times_out_and_is_retried_then_recomputed():
    workload = small_workload(3, 8)
    result, _ = run(workload, spec=FaultSpec(load_hang=1.0))
    assert result.stats.loads > 0
    assert result.stats.load_failures == result.stats.loads  # every load stalled and timed out
    assert result.leaked_gpu_pages == result.leaked_host_pages == 0
    assert all(o.phase is Phase.FINISHED for o in result.outputs.values())


def test_load_failure_policy_fail_ends_the_request_failed_with_a_reason():
    workload = small_workload(3, 8)
    result, _ = run(workload, gate=KvGateConfig(load_failure="fail"), spec=FaultSpec(load_fail=1.0))
    failed = [o for o in result.outputs.values() if o.phase is Phase.FAILED]
    assert failed and all(o.finish_reason.startswith("load failed: LoadFault") for o in failed)
    assert result.leaked_gpu_pages == result.leaked_host_pages == 0


fault_specs = st.builds(
    FaultSpec,
    seed=st.integers(0, 2**16),
    load_fail=st.sampled_from([0.0, 0.2, 0.6]),
    load_fail_late=st.sampled_from([0.0, 0.2]),
    load_hang=st.sampled_from([0.0, 0.2]),
    slow_store=st.sampled_from([0.0, 0.3]),
    store_delay_ms=st.just(0.5),
    host_shrink=st.sampled_from([0.0, 0.1, 0.3]),
    gpu_refuse=st.sampled_from([0.0, 0.05, 0.15]),
    abort=st.sampled_from([0.0, 0.05, 0.2]),
    abort_phases=st.sets(st.sampled_from(ABORT_PHASES), min_size=1).map(lambda s: tuple(sorted(s))),
)


@given(
    spec=fault_specs,
    workload_seed=st.integers(0, 10_000),
    load_failure=st.sampled_from(["recompute", "fail"]),
)
def test_every_fault_schedule_leaves_no_leak_accounts_for_every_request_and_keeps_tokens(
    spec, workload_seed, load_failure, tmp_path_factory
):
    workload = small_workload(workload_seed, 7)
    reference, _ = run(workload)
    log = tmp_path_factory.mktemp("faults") / "kv.jsonl"
    results = []
    for path in ("legacy", "plan"):
        for compare in ("off", "raise"):
            gate = KvGateConfig(
                path=path, compare=compare, compare_log=str(log), load_failure=load_failure
            )
            # check_integrity after every step
            result, injector = run(workload, gate=gate, spec=spec)
            assert result.leaked_gpu_pages == 0 and result.leaked_host_pages == 0
            assert result.loads_in_flight == 0 and result.live_requests == 0
            assert set(result.outputs) == {r.uuid for r in workload.requests}
            for output in result.outputs.values():
                assert output.phase in (Phase.FINISHED, Phase.FAILED) and output.finish_reason
            finished = {u: o for u, o in result.outputs.items() if o.finish_reason == "length"}
            assert compare_outputs({u: reference.outputs[u] for u in finished}, finished) == []
            if compare == "raise":
                assert sum(result.compare_summary.divergences.values()) == 0
            results.append(result.outputs)
    assert all(outputs == results[0] for outputs in results), (
        "paths and compare mode saw different outcomes"
    )
