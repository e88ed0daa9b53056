"""Sampling: the top-2 search and the log-probabilities it reports, against torch's own."""

import math

import pytest
import torch

from batchgen.engine.sampler import log_normaliser, sample, top2, top2_and_normaliser
from batchgen.state import Request, RequestState


@pytest.mark.parametrize("vocab_size", [2, 97, 128, 129, 200, 4096, 32001])
def test_top2_finds_the_two_largest_logits_of_every_row(vocab_size):
    logits = torch.randn(6, vocab_size, generator=torch.Generator().manual_seed(vocab_size))
    # the two largest in one block, and in neighbouring blocks
    logits[1, :2] = torch.tensor([50.0, 40.0])
    logits[2, [63, 64] if vocab_size > 64 else [0, 1]] = torch.tensor([30.0, 31.0])

    values, ids = top2(logits)

    expected = logits.topk(2, dim=-1)
    assert torch.equal(ids, expected.indices)
    assert torch.equal(values, expected.values)


def test_greedy_sample_takes_the_argmax_and_reports_log_softmax_of_the_top_two():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1)) * 4
    reqs = [RequestState(Request(f"r{i}", (1, 2), 4), arrival_index=i) for i in range(3)]

    sampled = sample(logits, reqs)

    expected = torch.log_softmax(logits, dim=-1).topk(2, dim=-1)
    assert [token for token, _ in sampled] == logits.argmax(-1).tolist()
    assert [lp.top_ids for _, lp in sampled] == [tuple(row) for row in expected.indices.tolist()]
    torch.testing.assert_close(
        torch.tensor([lp.top_logprobs for _, lp in sampled]), expected.values, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("vocab_size", [2, 3, 97, 4096, 32001])
def test_the_cpu_kernel_finds_torchs_top_two_and_normaliser(vocab_size):
    logits = torch.randn(5, vocab_size, generator=torch.Generator().manual_seed(vocab_size)) * 6
    logits[1, -1] = 80.0  # the largest last
    logits[2, 0] = -torch.inf  # an excluded token

    values, ids, normaliser = top2_and_normaliser(logits)

    expected = logits.topk(2, dim=-1)
    assert torch.equal(ids, expected.indices) and torch.equal(values, expected.values)
    torch.testing.assert_close(normaliser, torch.logsumexp(logits, -1, keepdim=True))
    assert normaliser.shape == (5, 1) and normaliser.dtype == torch.float32


def test_the_cpu_kernel_takes_the_lower_id_first_among_equal_logits():
    logits = torch.zeros(2, 8)
    logits[0, [5, 2, 7]] = 3.0
    logits[1, [4, 6]] = torch.tensor([1.0, 2.0])
    _, ids, normaliser = top2_and_normaliser(logits)
    assert ids.tolist() == [[2, 5], [6, 4]]
    expected = math.log(3 * math.exp(3.0) + 5)
    assert normaliser[0, 0].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("bad", [torch.nan, torch.inf])
def test_rows_with_nan_or_infinity_take_torchs_path(bad):
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    logits[1, 150] = bad
    values, ids, normaliser = top2_and_normaliser(logits)
    expected_values, expected_ids = top2(logits)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(values, expected_values, equal_nan=True)
    expected = log_normaliser(logits, expected_values[:, :1])
    torch.testing.assert_close(normaliser, expected, equal_nan=True)
