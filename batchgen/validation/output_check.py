"""The near-tie rule: do two runs' outputs agree, allowing for float rounding?

Batch composition (which requests share a forward) changes float rounding, so
two correct runs of the same greedy workload can pick different tokens where
the top two candidates are (almost) tied. The rule, after vLLM's
``check_logprobs_close``, per request:

    tokens equal everywhere                        -> equal
    first differing position i is a near-tie       -> equal; nothing after i is compared
    anything else                                  -> a mismatch, described

Position i is a near-tie when each run's token is among the other run's top-2
ids at i, and the reference's log-probabilities of the two tokens (both among
its top-2: a sampled token need not be) differ by less than ``tolerance``.
``compare_exact`` makes the same checks with no allowance, for two runs that
batch identically. Everything here is pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from batchgen.state import RequestOutput

# Largest reference logprob gap still called a near-tie, per compute dtype.
# Measured on CPU with the ``tiny`` model: the same position's top logprob,
# computed in different batches (L2-2048 and L2-4096 with and without
# eviction), moved by at most 1e-6 in float32 (two ulps at |logprob| ~ 6),
# 5e-4 in float16 and 4e-3 in bfloat16, where exact ties (gap 0) and one-ulp
# gaps (2e-3) decided real mismatches. float32 gets 100x its measured noise
# (GPU kernels pick reduction orders per batch shape, so expect more than the
# CPU shows) and stays 10x below 1e-3; the half precisions get 2.5-4x theirs.
# A KV bug (a wrong page, a stale slot) moves logprobs by far more, and it
# shows at every position, not only where the top two happen to be tied.
NEAR_TIE_TOLERANCES = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2}


def compare_outputs(
    reference: Mapping[str, RequestOutput],
    candidate: Mapping[str, RequestOutput],
    *,
    tolerance: float = NEAR_TIE_TOLERANCES["float32"],
) -> list[str]:
    """Every way ``candidate`` differs from ``reference``; empty when they agree.

    Checks the same uuids on both sides, then per request (in reference order)
    the tokens under the near-tie rule and, unless a near-tie was tolerated
    (after which the runs may legitimately end differently), the final phase
    and finish reason.
    """
    if tolerance <= 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance}")
    problems = _uuid_problems(reference, candidate)
    for uuid, ref in reference.items():
        if uuid in candidate:
            problems += compare_request(ref, candidate[uuid], tolerance=tolerance)
    return problems


def compare_exact(
    reference: Mapping[str, RequestOutput], candidate: Mapping[str, RequestOutput]
) -> list[str]:
    """Every way ``candidate`` differs from ``reference`` in uuids, tokens, phase
    or finish reason, with no near-tie allowance (for runs that batch identically)."""
    problems = _uuid_problems(reference, candidate)
    for uuid, ref in reference.items():
        cand = candidate.get(uuid)
        if cand is None:
            continue
        position = first_difference(ref.output_ids, cand.output_ids)
        if position is not None:
            problems.append(
                f"{uuid}: tokens differ from position {position} ({len(ref.output_ids)} tokens in "
                f"the reference, {len(cand.output_ids)} in the candidate)"
            )
        if (ref.phase, ref.finish_reason) != (cand.phase, cand.finish_reason):
            problems.append(_ending_problem(ref, cand))
    return problems


def compare_request(
    reference: RequestOutput, candidate: RequestOutput, *, tolerance: float
) -> list[str]:
    """How one request's candidate output differs from its reference; empty when they agree."""
    uuid = reference.uuid
    position = first_difference(reference.output_ids, candidate.output_ids)
    if position is None:
        token_problems = []
    elif position >= min(len(reference.output_ids), len(candidate.output_ids)):
        token_problems = [
            f"{uuid}: {len(reference.output_ids)} tokens in the reference,"
            f" {len(candidate.output_ids)} in the candidate (equal up to position {position})"
        ]
    else:
        tie_problem = near_tie_problem(reference, candidate, position, tolerance=tolerance)
        if tie_problem is None:
            return []  # a tolerated near-tie: the rest may legitimately differ
        token_problems = [tie_problem]
    if (reference.phase, reference.finish_reason) != (candidate.phase, candidate.finish_reason):
        token_problems.append(_ending_problem(reference, candidate))
    return token_problems


def first_difference(reference_ids: tuple[int, ...], candidate_ids: tuple[int, ...]) -> int | None:
    """The first position where the token sequences differ (a length difference counts); None if
    equal."""
    for position, (ref_token, cand_token) in enumerate(zip(reference_ids, candidate_ids)):
        if ref_token != cand_token:
            return position
    if len(reference_ids) != len(candidate_ids):
        return min(len(reference_ids), len(candidate_ids))
    return None


def near_tie_problem(
    reference: RequestOutput, candidate: RequestOutput, position: int, *, tolerance: float
) -> str | None:
    """None when the differing tokens at ``position`` are a near-tie, else why not."""
    ref_token, cand_token = reference.output_ids[position], candidate.output_ids[position]
    where = (
        f"{reference.uuid}: token {position} is {ref_token} in the reference, {cand_token} in the"
        " candidate"
    )
    if position >= len(reference.output_logprobs) or position >= len(candidate.output_logprobs):
        return f"{where}, and a run has no logprobs there to judge a near-tie"
    ref_top, cand_top = reference.output_logprobs[position], candidate.output_logprobs[position]
    if (
        ref_token not in ref_top.top_ids
        or cand_token not in ref_top.top_ids
        or ref_token not in cand_top.top_ids
    ):
        return (
            f"{where}; not a near-tie: reference top-2 {list(ref_top.top_ids)}, "
            f"candidate top-2 {list(cand_top.top_ids)}"
        )
    logprob = dict(zip(ref_top.top_ids, ref_top.top_logprobs))
    gap = abs(logprob[ref_token] - logprob[cand_token])
    if gap >= tolerance:
        return (
            f"{where}; not a near-tie: reference logprob gap {gap:.3g} >= tolerance {tolerance:.3g}"
        )
    return None


def _uuid_problems(
    reference: Mapping[str, RequestOutput], candidate: Mapping[str, RequestOutput]
) -> list[str]:
    return [
        f"{uuid}: missing from the candidate run" for uuid in reference if uuid not in candidate
    ] + [f"{uuid}: not in the reference run" for uuid in candidate if uuid not in reference]


def _ending_problem(reference: RequestOutput, candidate: RequestOutput) -> str:
    return (
        f"{reference.uuid}: ended {reference.phase.value}/{reference.finish_reason} in the"
        f" reference, {candidate.phase.value}/{candidate.finish_reason} in the candidate"
    )
