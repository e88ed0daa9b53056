"""``PlanKvPath``'s op requests: which requests each op is asked to act on."""

from batchgen.kv.plan_path import PlanKvPath
from batchgen.validation.plan_fixture import LOGPROBS, make_target


def test_alloc_asks_for_requests_past_their_last_page_and_not_for_one_that_exactly_fills_it():
    target = make_target()  # page_size 4: run0 and run1 hold 2 pages (8 slots) each
    target.state.requests["run0"].append_token(5, LOGPROBS)  # 6 prompt + 2 output: exactly 8
    request = PlanKvPath(target).alloc_request(["run0", "run1", "wait4"])
    assert request.needing.uuids == ("run1", "wait4")  # run1: 9 tokens; wait4: not RUNNING yet
    assert request.needing.num_tokens == (9, 5)
    assert request.batch == ("run0", "run1", "wait4")
