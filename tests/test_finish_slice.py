"""The finish slice (``batchgen.finish``): its planner against the legacy oracle on hand-built
requests, compare mode shadowing the worker's finish step (a bug planted in the shadow is a
divergence showing both sides' values while the output stays right), its gate's names, values
and options, and ``batchgen validate`` running it in both directions."""

import inspect
import json
import random
import re

import pytest

import batchgen.finish.legacy as legacy
import batchgen.finish.planner as planner
import batchgen.validation.validate
from batchgen.cli import main
from batchgen.config import CacheConfig, EngineConfig
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest, builtin_workload
from batchgen.finish.gate import FINISH_GATES, FinishGateConfig
from batchgen.finish.legacy import LegacyFinish
from batchgen.finish.ops import plan_finish_ops
from batchgen.finish.plan_path import PlanFinish, finish_request
from batchgen.finish.planner import plan_finish
from batchgen.finish.plans import FinishPlan, TokenFinish
from batchgen.finish.shadow import fork_state, step_form
from batchgen.kv.gate import GATE_FLAGS, KvGateConfig, gate_config
from batchgen.model.loader import load_model
from batchgen.sampling_params import SamplingParams
from batchgen.shadow.wiring import gated_worker
from batchgen.state import Phase, Request, RequestState, TokenLogprobs, WorkerState
from compare import DivergenceRecord, GateError, RunSummary, read_log
from compare.explain import explain_record
from tests.stepping import step_to_end

LOGPROBS = TokenLogprobs((4, 5), (-0.5, -1.5))
EOS = 2
STEP = 7  # the worker's step in the hand-built states


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def running(uuid: str, *, max_new_tokens: int = 8, num_outputs: int = 2, **sampling):
    """A RUNNING request with ``num_outputs`` tokens (9s) already sampled."""
    request = Request(uuid, (5, 6, 7), max_new_tokens, sampling=SamplingParams(**sampling))
    return RequestState(
        request,
        arrival_index=0,
        phase=Phase.RUNNING,
        output_ids=[9] * num_outputs,
        output_logprobs=[LOGPROBS] * num_outputs,
        first_token_step=None if num_outputs == 0 else 3,
    )


def state_of(*requests: RequestState) -> WorkerState:
    return WorkerState(step=STEP, requests={r.uuid: r for r in requests})


# ---- the planner against the legacy oracle -------------------------------------------------------
# case -> (the request's sampling and limits, the token it samples, how it ends); it has 2 outputs
CASES = {
    "an EOS id ends it": ({}, EOS, "eos"),
    "an EOS id under ignore_eos does not": ({"ignore_eos": True}, EOS, None),
    "a stop token id ends it": ({"stop_token_ids": (8,)}, 8, "stop"),
    "a stop token id that is EOS too ends it as stop": ({"stop_token_ids": (EOS,)}, EOS, "stop"),
    "its max_new_tokens-th token ends it": ({"max_new_tokens": 3}, 4, "length"),
    "length wins over EOS on the last token": ({"max_new_tokens": 3}, EOS, "length"),
    "before min_tokens EOS does not end it": ({"min_tokens": 4}, EOS, None),
    "before min_tokens a stop token does not": ({"min_tokens": 4, "stop_token_ids": (8,)}, 8, None),
    "at min_tokens EOS ends it": ({"min_tokens": 3}, EOS, "eos"),
    "any other token goes on": ({}, 4, None),
}


@pytest.mark.parametrize(("limits", "token", "reason"), CASES.values(), ids=CASES)
def test_the_planner_ends_a_request_exactly_as_the_legacy_code_does(limits, token, reason):
    legacy, plan = state_of(running("r", **limits)), state_of(running("r", **limits))
    LegacyFinish(legacy).finish(["r"], [(token, LOGPROBS)], (EOS,))
    PlanFinish(plan).finish(["r"], [(token, LOGPROBS)], (EOS,))
    assert step_form(plan, ["r"]) == step_form(legacy, ["r"])
    assert step_form(plan, ["r"]) == {
        "requests": {
            "r": {
                "output_tail": [token],
                "phase": "FINISHED" if reason else "RUNNING",
                "finish_reason": reason,
            }
        },
        "tokens_generated": 1,
    }
    for state in (legacy, plan):
        req = state.requests["r"]
        assert (req.output_ids, req.output_logprobs) == ([9, 9, token], [LOGPROBS] * 3)
        assert (req.num_tokens, req.first_token_step) == (6, 3)


def test_the_plan_lists_each_served_request_in_batch_order_with_its_token_and_reason():
    state = state_of(running("a"), running("b", stop_token_ids=(8,)), running("c", num_outputs=7))
    request = finish_request(
        state, ["c", "b", "a"], [(4, LOGPROBS), (8, LOGPROBS), (EOS, LOGPROBS)], [EOS]
    )
    assert plan_finish(request) == FinishPlan(
        (
            TokenFinish("c", 4, LOGPROBS, "length"),
            TokenFinish("b", 8, LOGPROBS, "stop"),
            TokenFinish("a", EOS, LOGPROBS, "eos"),
        )
    )
    assert [r.num_outputs for r in request.requests] == [7, 2, 2]
    with pytest.raises(AttributeError):
        request.requests[0].token = 5  # what the planner reads is immutable


@pytest.mark.parametrize("path", [LegacyFinish, PlanFinish], ids=["legacy", "plan"])
def test_a_first_token_notes_its_step_and_a_request_not_served_keeps_its_abort(path):
    aborted = running("x")
    aborted.phase, aborted.finish_reason = Phase.FINISHED, "abort"
    state = state_of(running("r", num_outputs=0), aborted)
    path(state).finish(["r"], [(4, LOGPROBS)], (EOS,))
    first = state.requests["r"]
    assert (first.output_ids, first.first_token_step, state.stats.tokens_generated) == ([4], 7, 1)
    assert (aborted.phase, aborted.finish_reason, aborted.output_ids) == (
        Phase.FINISHED,
        "abort",
        [9, 9],
    )


def test_the_shadow_runs_on_copies_of_what_the_step_writes():
    state = state_of(running("r"))
    fork = fork_state(state, ["r"])
    LegacyFinish(fork).finish(["r"], [(EOS, LOGPROBS)], (EOS,))
    assert step_form(fork, ["r"])["requests"]["r"]["finish_reason"] == "eos"
    req = state.requests["r"]
    assert (req.output_ids, len(req.output_logprobs), req.phase, req.finish_reason) == (
        [9, 9],
        2,
        Phase.RUNNING,
        None,
    )
    assert (state.stats.tokens_generated, fork.stats.tokens_generated, fork.step) == (0, 1, STEP)


# ---- compare mode on a worker --------------------------------------------------------------------
def finish_worker(model, workload: Workload, gate: FinishGateConfig, **kv) -> Worker:
    return gated_worker(
        model,
        cache_config=workload.cache,
        engine_config=workload.engine,
        kv_gate=KvGateConfig(**kv),
        finish_gate=gate,
    )


def plain_outputs(model, workload: Workload) -> dict:
    worker = Worker(model, cache_config=workload.cache, engine_config=workload.engine)
    return run_workload(worker, workload).outputs


@pytest.mark.parametrize(("path", "shadow"), [("plan", "legacy"), ("legacy", "plan")])
def test_compare_mode_finds_no_divergence_on_the_smoke_workload(model, tmp_path, path, shadow):
    workload, log = builtin_workload("smoke"), tmp_path / "finish.jsonl"
    gate = FinishGateConfig(path=path, compare="raise", compare_log=str(log))
    worker = finish_worker(model, workload, gate, path=shadow, compare="raise")
    result = run_workload(worker, workload, check_integrity=True)
    assert result.outputs == plain_outputs(model, workload)
    [summary] = read_log(log).records
    assert isinstance(summary, RunSummary)
    assert (summary.binding, summary.workload, summary.authoritative, summary.shadow) == (
        "finish",
        "smoke",
        path,
        shadow,
    )
    # every step but the last, which only released
    assert (result.num_steps, summary.steps_compared, summary.divergences) == (
        42,
        {"finish": 41},
        {},
    )


@pytest.mark.parametrize(("path", "shadow"), [("plan", "legacy"), ("legacy", "plan")])
def test_compare_mode_finds_no_divergence_on_every_finish_reason(
    model, tmp_path, monkeypatch, path, shadow
):
    greedy = plain_outputs(model, builtin_workload("smoke"))["smoke-r0"].output_ids
    monkeypatch.setattr(
        model, "config", model.config.model_copy(update={"eos_token_ids": (greedy[2],)})
    )
    gate = FinishGateConfig(path=path, compare="raise", compare_log=str(tmp_path / "f.jsonl"))
    worker = finish_worker(model, builtin_workload("smoke"), gate)
    prompt = builtin_workload("smoke").requests[0].prompt_ids
    samplings = {
        "eos": SamplingParams(),
        "stop": SamplingParams(stop_token_ids=(greedy[1],), ignore_eos=True),
        "held": SamplingParams(min_tokens=4),  # its EOS masked for 4 tokens
        "abort": SamplingParams(ignore_eos=True),
    }
    for uuid, sampling in samplings.items():
        worker.add_request(Request(uuid, tuple(prompt), 6, sampling=sampling))
    with worker.finish_compare.begin_run("reasons", seed=0) as experiment:
        worker.step()
        worker.abort("abort")
        step_to_end(worker, 50)
    ends = {uuid: (o.finish_reason, len(o.output_ids)) for uuid, o in worker.take_outputs().items()}
    assert ends == {
        "eos": ("eos", 3),
        "stop": ("stop", 2),
        "held": ("length", 6),
        "abort": ("abort", 1),
    }
    assert (experiment.summary.divergences, experiment.summary.steps_compared) == (
        {},
        {"finish": 6},
    )


def test_a_bug_planted_in_the_shadow_planner_is_a_divergence_showing_both_values(
    model, tmp_path, monkeypatch
):
    workload, log = builtin_workload("smoke"), tmp_path / "finish.jsonl"
    expected = plain_outputs(model, workload)
    right = planner.finish_reason_of

    def one_token_late(sampled, eos_ids):  # the bug: max_new_tokens off by one
        return right(sampled._replace(max_new_tokens=sampled.max_new_tokens + 1), eos_ids)

    monkeypatch.setattr(planner, "finish_reason_of", one_token_late)  # the plan path's only
    gate = FinishGateConfig(path="legacy", compare="log", compare_log=str(log))
    result = run_workload(finish_worker(model, workload, gate), workload)
    assert result.outputs == expected  # the authoritative legacy path ended them right
    *divergences, summary = read_log(log).records
    assert summary.divergences == {"finish": len(divergences)} == {"finish": 7}
    first = divergences[0]
    assert isinstance(first, DivergenceRecord)
    assert (first.binding, first.op, first.authoritative, first.shadow, first.kind) == (
        "finish",
        "finish",
        "legacy",
        "plan",
        "state",
    )
    assert [row.text for row in explain_record(first)] == [
        'requests[smoke-r1].finish_reason  legacy: "length"  plan: null',
        'requests[smoke-r1].phase  legacy: "FINISHED"  plan: "RUNNING"',
    ]
    ended = {re.match(r"requests\[(.+)\]", p)[1] for d in divergences for p in d.field_paths}
    assert ended == set(expected)  # each request's last step diverged (two ended on one step)


# ---- the gate ------------------------------------------------------------------------------------
def test_a_typo_in_the_family_is_refused_naming_the_closest_variable_and_the_valid_ones():
    valid = ", ".join(sorted(env for env, _, _ in FINISH_GATES.flags.values()))
    with pytest.raises(GateError) as raised:
        FINISH_GATES.parse({"BATCHGEN_WORKER_FINISH_COMPARE_SAMPEL": "0.5"})
    assert str(raised.value) == (
        "unknown variable BATCHGEN_WORKER_FINISH_COMPARE_SAMPEL (did you mean"
        f" BATCHGEN_WORKER_FINISH_COMPARE_SAMPLE?); valid names: {valid}"
    )
    with pytest.raises(GateError, match=r"^unknown variable BATCHGEN_WORKER_FINSH_PATH \(did you"):
        FINISH_GATES.parse({"BATCHGEN_WORKER_FINSH_PATH": "plan"})


def test_a_bad_value_names_the_variable_the_allowed_values_and_the_closest():
    with pytest.raises(GateError) as raised:
        FINISH_GATES.parse({"BATCHGEN_WORKER_FINISH_PATH": "legacyy"})
    assert str(raised.value) == (
        "BATCHGEN_WORKER_FINISH_PATH='legacyy' is invalid (Input should be 'plan' or 'legacy');"
        " allowed: plan, legacy; did you mean 'legacy'?"
    )


def test_the_kv_and_finish_families_share_an_environment_without_refusing_each_other():
    every_kv = {env: "x" for env, _, _ in GATE_FLAGS.values()}  # values the KV gate would refuse
    every_finish = {env: "x" for env, _, _ in FINISH_GATES.flags.values()}
    kv = gate_config({**every_finish, "BATCHGEN_WORKER_KV_PATH": "legacy"})
    finish = FINISH_GATES.parse({**every_kv, "BATCHGEN_WORKER_FINISH_COMPARE": "log"})
    assert (kv.path, finish.path, finish.compare, finish.shadow_path) == (
        "legacy",
        "plan",
        "log",
        "legacy",
    )


def test_the_defaults_are_the_plan_path_with_nothing_watching():
    gate = FINISH_GATES.parse({})
    assert (gate.path, gate.compare, gate.compare_log, gate.compare_ops) == (
        "plan",
        "off",
        "finish-divergences.jsonl",
        ("finish",),
    )
    assert inspect.signature(Worker).parameters["finish_ops"].default is plan_finish_ops
    ops, compare = plan_finish_ops(WorkerState())
    assert isinstance(ops, PlanFinish) and compare is None


def test_run_takes_the_options_over_the_environment_and_refuses_a_typo(
    tmp_path, monkeypatch, capsys
):
    log = tmp_path / "finish.jsonl"
    monkeypatch.setenv("BATCHGEN_WORKER_FINISH_COMPARE", "log")
    argv = ["run", "--workload", "smoke", "--json", "--finish-path", "legacy"]
    assert main([*argv, "--finish-compare-log", str(log)]) == 0
    [summary] = read_log(log).records
    assert (summary.authoritative, summary.shadow, summary.divergences) == ("legacy", "plan", {})
    monkeypatch.setenv("BATCHGEN_WORKER_FINISH_PTH", "plan")
    assert main(argv) == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith(
            "batchgen: error: unknown variable BATCHGEN_WORKER_FINISH_PTH (did you mean"
            " BATCHGEN_WORKER_FINISH_PATH?)"
        )
    )


# ---- batchgen validate ---------------------------------------------------------------------------
@pytest.fixture
def small_validation(monkeypatch, tmp_path):
    """Validate runs two small pressure traces and no corpus; coverage is not judged."""
    rng, paths = random.Random(1), []
    for name in ("pa", "pb"):
        requests = [
            WorkloadRequest(
                uuid=f"{name}-r{i}",
                prompt_ids=[rng.randrange(1, 512) for _ in range(rng.randint(5, 14))],
                max_new_tokens=rng.randint(10, 20),
                arrival_step=i // 4,
            )
            for i in range(8)
        ]
        workload = Workload(
            name=name,
            cache=CacheConfig(page_size=4, num_gpu_pages=10, num_host_pages=6),
            engine=EngineConfig(max_num_seqs=8),
            requests=requests,
        )
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(workload.model_dump_json())
    (tmp_path / "corpus").mkdir()
    validate = batchgen.validation.validate
    monkeypatch.setattr(validate, "BACK_TO_BACK_WORKLOADS", tuple(map(str, paths)))
    monkeypatch.setattr(validate, "CORPUS_DIR", tmp_path / "corpus")
    monkeypatch.setattr(validate, "coverage_failures", lambda report: [])
    monkeypatch.setattr(validate, "copy_pattern_failures", lambda report, required: [])


def test_validate_shadows_the_finish_step_in_every_direction_and_its_summary_shows_it(
    small_validation, tmp_path, capsys
):
    assert main(["validate", "--reports-dir", str(tmp_path / "reports")]) == 0
    out = capsys.readouterr().out
    [compared] = re.findall(r"^steps compared: .*$", out, re.M)
    assert re.fullmatch(
        r"steps compared: alloc \d+, evict \d+, finish \d+, migrate \d+, poll \d+, release \d+",
        compared,
    )
    assert "divergences: 0 (alloc 0, evict 0, finish 0, migrate 0, poll 0, release 0);" in out
    summaries = read_log(tmp_path / "reports" / "divergences.jsonl").records
    finish = [(s.workload, s.authoritative, s.shadow) for s in summaries if s.binding == "finish"]
    assert finish == [
        (f"{name} {role}", *role.split("/"))
        for role in ("legacy/plan", "plan/legacy", "plan/plan")
        for name in ("pa", "pb")
    ]
    assert all(s.steps_compared["finish"] > 0 for s in summaries if s.binding == "finish")


def test_validate_fails_a_run_whose_finish_shadow_diverges_naming_it(
    small_validation, tmp_path, capsys, monkeypatch
):
    right = legacy.finish_reason

    def one_token_late(req, token, eos_ids):  # the bug, in the legacy path: ends a token late
        reason = right(req, token, eos_ids)
        return (
            None
            if reason == "length" and len(req.output_ids) == req.request.max_new_tokens
            else reason
        )

    monkeypatch.setattr(legacy, "finish_reason", one_token_late)
    assert main(["validate", "--json", "--reports-dir", str(tmp_path / "reports")]) == 1
    report = json.loads(capsys.readouterr().out)
    first = "first: finish step 16, state at requests[pa-r0].finish_reason, requests[pa-r0].phase"
    assert report["failures"] == [
        "pa legacy/plan: 1 divergence of the plan shadow from the authoritative legacy path"
        f" (finish: 1); {first}",
        "pa plan/legacy: 1 divergence of the legacy shadow from the authoritative plan path"
        f" (finish: 1); {first}",
    ]
    # raise mode stopped each diverging direction's worker at its first run; plan/plan ran both
    assert [(r["workload"], r["role"]) for r in report["runs"]][:2] == [
        ("pa", "plan/plan"),
        ("pb", "plan/plan"),
    ]


def test_a_typo_of_the_finish_prefix_is_named_by_the_finish_family_not_the_kv_one():
    from batchgen.kv.gate import gate_config

    typo = {"BATCHGEN_WORKER_FINSH_COMPARE": "log"}
    assert gate_config(typo).compare == "off"  # not the KV family's name to refuse
    with pytest.raises(GateError, match=r"did you mean BATCHGEN_WORKER_FINISH_COMPARE\?"):
        FINISH_GATES.parse(typo)
