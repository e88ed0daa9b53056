"""Sampling parameters in the engine: masks, draws that ignore the batch, min_tokens, stops, EOS,
log-probabilities."""

import math

import pytest
import torch

from batchgen.config import CacheConfig
from batchgen.engine.request_checks import RequestError
from batchgen.engine.sampler import filter_logits, sample
from batchgen.engine.worker import Worker
from batchgen.model.loader import load_model
from batchgen.sampling_params import SamplingParams
from batchgen.state import Request, RequestState
from tests.stepping import step_to_end

CACHE = CacheConfig(page_size=4, num_gpu_pages=64, num_host_pages=8)
PROMPTS = [(5, 9, 13, 2), (7, 1, 8), (30, 31, 32, 33, 34), (3,)]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=3)


def run(model, requests: list[Request], eos_ids: tuple[int, ...] = ()) -> dict:
    """uuid -> (output ids, finish reason) after running ``requests`` together on a fresh worker
    whose model ends at ``eos_ids``."""
    model.config = model.config.model_copy(update={"eos_token_ids": eos_ids})
    worker = Worker(model, cache_config=CACHE)
    for request in requests:
        worker.add_request(request)
    step_to_end(worker, 200)
    return {u: (o.output_ids, o.finish_reason) for u, o in worker.take_outputs().items()}


def states(params: list[SamplingParams], temperature: float = 1.0) -> list[RequestState]:
    return [
        RequestState(Request(f"r{i}", (1, 2), 8, temperature, seed=i, sampling=p), arrival_index=i)
        for i, p in enumerate(params)
    ]


def test_greedy_tokens_are_the_argmax_of_each_row(model):
    outputs = run(model, [Request("g", PROMPTS[0], 6)])
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    tokens = [token for token, _ in sample(logits, states([SamplingParams()] * 4, 0.0))]
    assert tokens == logits.argmax(-1).tolist()
    assert outputs["g"][1] == "length" and len(outputs["g"][0]) == 6


def test_top_k_1_samples_exactly_the_greedy_tokens(model):
    greedy = run(model, [Request(f"g{i}", p, 8) for i, p in enumerate(PROMPTS)])
    top1 = run(
        model,
        [
            Request(f"g{i}", p, 8, temperature=1.5, seed=i, sampling=SamplingParams(top_k=1))
            for i, p in enumerate(PROMPTS)
        ],
    )
    assert top1 == greedy


def test_a_seeded_request_samples_the_same_tokens_in_any_batch(model):
    alone = run(model, [Request("s", PROMPTS[0], 12, temperature=1.0, seed=42)])
    crowd = [Request(f"o{i}", p, 5 + i, temperature=0.7, seed=i) for i, p in enumerate(PROMPTS)]
    together = run(model, [*crowd[:2], Request("s", PROMPTS[0], 12, 1.0, 42), *crowd[2:]])
    other_seed = run(model, [Request("s", PROMPTS[0], 12, temperature=1.0, seed=43)])
    assert together["s"] == alone["s"]
    assert other_seed["s"] != alone["s"]  # the seed does choose the draws


def test_top_p_keeps_the_tokens_whose_mass_before_them_is_below_top_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    kept = filter_logits(probs.log(), [SamplingParams(top_p=0.7)]).isfinite()
    assert kept.tolist() == [[False, True, False, True]]  # 0.5, then 0.3 (0.5 before it < 0.7)


def test_min_p_drops_tokens_below_min_p_times_the_most_likely():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    kept = filter_logits(probs.log(), [SamplingParams(min_p=0.25)]).isfinite()
    assert kept.tolist() == [[False, True, True, True]]  # 0.15 >= 0.125 stays, 0.05 goes


def test_top_k_keeps_the_k_most_likely_and_every_draw_lands_among_them():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(top_k=3)] * 64
    allowed = logits.topk(3, dim=-1).indices.tolist()
    tokens = [token for token, _ in sample(logits, states(params, temperature=2.0))]
    assert all(token in allowed[row] for row, token in enumerate(tokens))
    assert len(set(tokens) - {row[0] for row in allowed}) > 0  # not just the argmax


def test_min_tokens_masks_eos_until_that_many_tokens(model):
    greedy = run(model, [Request("e", PROMPTS[1], 10)])["e"][0]
    eos = greedy[1]  # the greedy run's second token
    ended = run(model, [Request("e", PROMPTS[1], 10)], eos_ids=(eos,))["e"]
    held = run(
        model,
        [Request("e", PROMPTS[1], 10, sampling=SamplingParams(min_tokens=4))],
        eos_ids=(eos,),
    )["e"]
    assert ended == (greedy[:2], "eos")
    assert eos not in held[0][:4] and held[0][:1] == greedy[:1]


def test_ignore_eos_runs_to_max_tokens_and_stop_token_ids_still_stop(model):
    greedy = run(model, [Request("i", PROMPTS[2], 9)])["i"][0]
    eos = greedy[2]
    ignoring = SamplingParams(ignore_eos=True)
    assert run(model, [Request("i", PROMPTS[2], 9, sampling=ignoring)], eos_ids=(eos,))["i"] == (
        greedy,
        "length",
    )
    stopping = SamplingParams(stop_token_ids=(greedy[3],))
    assert run(model, [Request("i", PROMPTS[2], 9, sampling=stopping)])["i"] == (
        greedy[:4],
        "stop",
    )


def test_requested_logprobs_hold_the_sampled_token_and_the_top_n():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(num_logprobs=5), SamplingParams(), SamplingParams(num_logprobs=0)]
    sampled = sample(logits, states(params, temperature=0.0))
    expected = torch.log_softmax(logits, dim=-1)
    (t0, lp0), (_, lp1), (t2, lp2) = sampled
    top5 = expected[0].topk(5)
    assert [i for i, _ in lp0.top] == top5.indices.tolist()
    assert [v for _, v in lp0.top] == pytest.approx(top5.values.tolist(), abs=1e-5)
    assert lp0.token_logprob == pytest.approx(float(expected[0, t0]), abs=1e-5)
    assert (lp1.token_logprob, lp1.top) == (None, ())
    assert lp2.top == () and math.isclose(lp2.token_logprob, float(expected[2, t2]), abs_tol=1e-5)


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(top_p=0.0), r"sampling\.top_p=0\.0; must be a number in \(0, 1\]"),
        (SamplingParams(top_k=-1), r"sampling\.top_k=-1; must be an int >= 0"),
        (SamplingParams(min_p=1.5), r"sampling\.min_p=1\.5; must be a number in \[0, 1\]"),
        (SamplingParams(min_tokens=9), r"min_tokens=9; must be an int in \[0, max_new_tokens = 4"),
        (SamplingParams(num_logprobs=21), r"num_logprobs=21; must be None or an int in \[0, 20\]"),
        (SamplingParams(stop_token_ids=(512,)), r"stop_token_ids=\(512,\); must be a tuple"),
    ],
)
def test_an_out_of_range_sampling_parameter_is_refused_naming_it(model, params, message):
    worker = Worker(model, cache_config=CACHE)
    with pytest.raises(RequestError, match=message):
        worker.add_request(Request("bad", (1, 2), 4, sampling=params))
    assert worker.state.requests == {}
