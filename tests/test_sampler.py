"""Sampling: the top-2 search and the log-probabilities it reports, against torch's own."""

import pytest
import torch

from batchgen.engine.sampler import sample, top2
from batchgen.engine.state import Request, RequestState


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
