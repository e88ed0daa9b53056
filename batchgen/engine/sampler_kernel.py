"""The sampler's two reductions over float32 logits on a CPU, as one numba kernel.

Every step the sampler needs each row's two largest logits with their ids, and its
log-normaliser (logsumexp). torch takes about a dozen small ops for them (block maxima, two top-2s,
gathers; a subtraction, exp, sum and log), each costing several times its arithmetic after a
forward has streamed its weights through the caches: in a 32-row step of a 4096-token vocabulary
on one core, 0.41 ms against this kernel's 0.25 ms. Here each row is two passes, one call for the
batch.

Compiled on first call and cached on disk beside this file.
"""

from __future__ import annotations

import numba
import numpy as np

from batchgen.model.paged_decode_kernel import exp_nonpositive


@numba.njit(cache=True, boundscheck=False)
def top2_and_normaliser(logits, top_values, top_ids, normalisers):
    """For each row of ``logits`` [rows, vocab >= 2]: its two largest logits, largest first, into
    ``top_values`` [rows, 2] and their ids into ``top_ids`` (the lower id first among equals, as
    argmax takes it), and ``log(sum(exp(logits)))`` into ``normalisers`` [rows] (exp(logit - max)
    summed in float32). A row holding NaN, or no finite maximum, gets a NaN normaliser. Writes
    the three outputs."""
    for row in range(logits.shape[0]):
        x = logits[row]
        first, first_id, second, second_id = x[0], 0, x[1], 1
        if second > first:
            first, first_id, second, second_id = second, 1, first, 0
        for e in range(2, x.shape[0]):
            if x[e] > second:  # rare past the first few: the branch predicts well
                if x[e] > first:
                    first, first_id, second, second_id = x[e], e, first, first_id
                else:
                    second, second_id = x[e], e
        top_values[row, 0], top_values[row, 1] = first, second
        top_ids[row, 0], top_ids[row, 1] = first_id, second_id
        normalisers[row] = np.log(_sum_exp_below(x, first)) + first


# a call, not inlined: numba inlines into the caller's IR, whose flags (no reassociation) would
# keep the sum sequential (32 rows of 4096: 474 us so in float64, 45 us as this call)
@numba.njit(fastmath={"reassoc"}, boundscheck=False)
def _sum_exp_below(x, peak):
    """``sum(exp(x - peak))`` for ``peak`` >= every element of ``x``, summed in float32 lanes as
    torch's ``logsumexp`` sums; NaN where ``x`` holds NaN or ``peak`` is not finite. Pure."""
    total = np.float32(0.0)
    for e in range(x.shape[0]):
        total += exp_nonpositive(x[e] - peak)
    return total
