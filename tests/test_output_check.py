"""The near-tie rule: equal outputs pass, near-ties pass, real differences are named."""

import pytest

from batchgen.state import Phase, RequestOutput, TokenLogprobs
from batchgen.validation.output_check import NEAR_TIE_TOLERANCES, compare_exact, compare_outputs

FLAT = TokenLogprobs(top_ids=(1, 2), top_logprobs=(-1.0, -3.0))  # a clear winner: no tie


def output(
    uuid: str,
    tokens: list[int],
    logprobs: list[TokenLogprobs] | None = None,
    *,
    phase: Phase = Phase.FINISHED,
    reason: str = "length",
) -> RequestOutput:
    logprobs = (
        logprobs
        if logprobs is not None
        else [TokenLogprobs((t, t + 1), (-1.0, -3.0)) for t in tokens]
    )
    return RequestOutput(uuid, phase, reason, tuple(tokens), tuple(logprobs))


def test_identical_outputs_have_no_mismatch():
    runs = {"a": output("a", [5, 6, 7]), "b": output("b", [9])}
    assert compare_outputs(runs, dict(runs)) == []
    assert compare_exact(runs, dict(runs)) == []


def test_near_tie_at_first_difference_is_accepted_and_the_rest_is_not_compared():
    tie_ref = TokenLogprobs((40, 41), (-2.00000, -2.00005))
    tie_cand = TokenLogprobs((41, 40), (-2.00001, -2.00002))
    reference = {"a": output("a", [5, 40, 1, 2], [FLAT, tie_ref, FLAT, FLAT])}
    candidate = {
        "a": output("a", [5, 41, 9, 9, 9], [FLAT, tie_cand, FLAT, FLAT, FLAT], reason="eos")
    }
    assert compare_outputs(reference, candidate) == []


def test_near_tie_beyond_the_tolerance_is_a_mismatch():
    ref_top = TokenLogprobs((40, 41), (-2.0, -2.0 - 2 * NEAR_TIE_TOLERANCES["float32"]))
    cand_top = TokenLogprobs((41, 40), (-2.0, -2.0))
    reference = {"a": output("a", [40], [ref_top])}
    candidate = {"a": output("a", [41], [cand_top])}
    assert compare_outputs(reference, candidate) == [
        "a: token 0 is 40 in the reference, 41 in the candidate; not a near-tie: reference logprob"
        " gap 0.0002 >= tolerance 0.0001"
    ]
    assert compare_outputs(reference, candidate, tolerance=1e-3) == []


def test_token_outside_the_other_runs_top2_is_a_mismatch():
    reference = {"a": output("a", [5, 6], [FLAT, TokenLogprobs((6, 7), (-1.0, -1.0))])}
    candidate = {"a": output("a", [5, 8], [FLAT, TokenLogprobs((8, 6), (-1.0, -1.0))])}
    assert compare_outputs(reference, candidate) == [
        "a: token 1 is 6 in the reference, 8 in the candidate; not a near-tie: reference top-2 [6,"
        " 7], candidate top-2 [8, 6]"
    ]


def test_a_reference_token_outside_its_own_top2_is_a_mismatch():
    # a sampled reference token need not be in its own top-2: the reference has no logprob for it to
    # judge by
    reference = {"a": output("a", [7], [TokenLogprobs((1, 2), (-1.0, -1.00001))])}
    candidate = {"a": output("a", [2], [TokenLogprobs((1, 7), (-1.0, -1.00001))])}
    assert compare_outputs(reference, candidate) == [
        "a: token 0 is 7 in the reference, 2 in the candidate; not a near-tie: reference top-2 [1,"
        " 2], candidate top-2 [1, 7]"
    ]


def test_only_the_first_difference_may_be_a_near_tie():
    tie = TokenLogprobs((40, 41), (-2.0, -2.0))
    reference = {"a": output("a", [5, 40], [FLAT, tie])}
    candidate = {"a": output("a", [6, 41], [FLAT, tie])}
    problems = compare_outputs(reference, candidate)
    assert len(problems) == 1 and problems[0].startswith(
        "a: token 0 is 5 in the reference, 6 in the candidate"
    )


def test_missing_and_extra_uuids_are_reported():
    reference = {"a": output("a", [1]), "b": output("b", [2])}
    candidate = {"a": output("a", [1]), "c": output("c", [3])}
    expected = ["b: missing from the candidate run", "c: not in the reference run"]
    assert compare_outputs(reference, candidate) == expected
    assert compare_exact(reference, candidate) == expected


def test_different_ending_is_reported_with_equal_tokens():
    reference = {"a": output("a", [1, 2])}
    candidate = {"a": output("a", [1, 2], phase=Phase.FINISHED, reason="abort")}
    assert compare_outputs(reference, candidate) == [
        "a: ended finished/length in the reference, finished/abort in the candidate"
    ]


def test_a_shorter_run_is_a_mismatch():
    reference = {"a": output("a", [1, 2, 3])}
    candidate = {"a": output("a", [1, 2], reason="eos")}
    assert compare_outputs(reference, candidate) == [
        "a: 3 tokens in the reference, 2 in the candidate (equal up to position 2)",
        "a: ended finished/length in the reference, finished/eos in the candidate",
    ]


def test_missing_logprobs_cannot_make_a_near_tie():
    reference = {"a": output("a", [1, 2], [FLAT])}
    candidate = {"a": output("a", [1, 3], [FLAT])}
    assert compare_outputs(reference, candidate) == [
        "a: token 1 is 2 in the reference, 3 in the candidate, and a run has no logprobs there to"
        " judge a near-tie"
    ]


def test_exact_comparison_allows_no_near_tie():
    tie = TokenLogprobs((40, 41), (-2.0, -2.0))
    reference = {"a": output("a", [40], [tie])}
    candidate = {"a": output("a", [41], [TokenLogprobs((41, 40), (-2.0, -2.0))])}
    assert compare_outputs(reference, candidate) == []
    assert compare_exact(reference, candidate) == [
        "a: tokens differ from position 0 (1 tokens in the reference, 1 in the candidate)"
    ]


def test_tolerance_must_be_positive():
    with pytest.raises(ValueError, match="tolerance must be > 0, got 0"):
        compare_outputs({}, {}, tolerance=0)
