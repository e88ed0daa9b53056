"""The near-tie rule: do two runs' outputs agree, allowing for float rounding?

Batch composition (which requests share a forward) changes float rounding, so
two correct runs of the same greedy workload can pick different tokens where
the top two candidates are (almost) tied. The rule, after vLLM's
``check_logprobs_close``, per request:

    tokens equal everywhere                        -> equal
    first differing position i is a near-tie       -> equal; nothing after i is compared
    anything else                                  -> a mismatch, described

Position i is a near-tie when each run's token is among the other run's top-2
ids at i, and the reference's log-probabilities of the two tokens differ by
less than ``tolerance``. Everything here is pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from batchgen.worker.state import RequestOutput

# fp32 logits of the same position computed in different batches differ by
# ~1e-6 (accumulation order in the matmuls and the attention softmax); a gap
# of 1e-4 is two orders of magnitude above that rounding noise, yet far below
# any gap a real KV bug (a wrong page, a stale slot) produces, which moves
# log-probabilities by 1e-2 or more. Lower precisions need a looser bound:
# bfloat16 carries 8 mantissa bits, so use ~1e-1 there.
FP32_NEAR_TIE_TOLERANCE = 1e-4


def compare_outputs(
    reference: Mapping[str, RequestOutput],
    candidate: Mapping[str, RequestOutput],
    *,
    tolerance: float = FP32_NEAR_TIE_TOLERANCE,
) -> list[str]:
    """Every way ``candidate`` differs from ``reference``; empty when they agree.

    Checks the same uuids on both sides, then per request (in reference order)
    the tokens under the near-tie rule and, unless a near-tie was tolerated
    (after which the runs may legitimately end differently), the final phase
    and finish reason.
    """
    if tolerance <= 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance}")
    problems = [f"{uuid}: missing from the candidate run" for uuid in reference if uuid not in candidate]
    problems += [f"{uuid}: not in the reference run" for uuid in candidate if uuid not in reference]
    for uuid, ref in reference.items():
        if uuid in candidate:
            problems += compare_request(ref, candidate[uuid], tolerance=tolerance)
    return problems


def compare_request(reference: RequestOutput, candidate: RequestOutput, *, tolerance: float) -> list[str]:
    """How one request's candidate output differs from its reference; empty when they agree."""
    uuid = reference.uuid
    position = first_difference(reference.output_ids, candidate.output_ids)
    if position is None:
        token_problems = []
    elif position >= min(len(reference.output_ids), len(candidate.output_ids)):
        token_problems = [
            f"{uuid}: {len(reference.output_ids)} tokens in the reference, {len(candidate.output_ids)} in the "
            f"candidate (equal up to position {position})"
        ]
    else:
        tie_problem = near_tie_problem(reference, candidate, position, tolerance=tolerance)
        if tie_problem is None:
            return []  # a tolerated near-tie: the rest may legitimately differ
        token_problems = [tie_problem]
    if (reference.phase, reference.finish_reason) != (candidate.phase, candidate.finish_reason):
        token_problems.append(
            f"{uuid}: ended {reference.phase.value}/{reference.finish_reason} in the reference, "
            f"{candidate.phase.value}/{candidate.finish_reason} in the candidate"
        )
    return token_problems


def first_difference(reference_ids: tuple[int, ...], candidate_ids: tuple[int, ...]) -> int | None:
    """The first position where the token sequences differ (a length difference counts); None if equal."""
    for position, (ref_token, cand_token) in enumerate(zip(reference_ids, candidate_ids)):
        if ref_token != cand_token:
            return position
    if len(reference_ids) != len(candidate_ids):
        return min(len(reference_ids), len(candidate_ids))
    return None


def near_tie_problem(reference: RequestOutput, candidate: RequestOutput, position: int, *, tolerance: float) -> str | None:
    """None when the differing tokens at ``position`` are a near-tie, else why not."""
    ref_token, cand_token = reference.output_ids[position], candidate.output_ids[position]
    where = f"{reference.uuid}: token {position} is {ref_token} in the reference, {cand_token} in the candidate"
    if position >= len(reference.output_logprobs) or position >= len(candidate.output_logprobs):
        return f"{where}, and a run has no logprobs there to judge a near-tie"
    ref_top, cand_top = reference.output_logprobs[position], candidate.output_logprobs[position]
    if cand_token not in ref_top.top_ids or ref_token not in cand_top.top_ids:
        return (f"{where}; not a near-tie: reference top-2 {list(ref_top.top_ids)}, "
                f"candidate top-2 {list(cand_top.top_ids)}")
    logprob = dict(zip(ref_top.top_ids, ref_top.top_logprobs))
    gap = abs(logprob[ref_token] - logprob[cand_token])
    if gap >= tolerance:
        return f"{where}; not a near-tie: reference logprob gap {gap:.3g} >= tolerance {tolerance:.3g}"
    return None
