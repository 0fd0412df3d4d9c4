"""Decodes carry their requests' proposals: the budget counts them, `is_prefill` discounts them, accepted tokens
advance the request, and proposals never preempt anyone."""
from ecoserve.clock import VirtualClock
from ecoserve.config import CacheConfig, SchedulerConfig
from ecoserve.request import Request, RequestStatus
from ecoserve.sampling import SamplingParams
from ecoserve.sched import Scheduler, StepResult


def running_pair(num_blocks: int, budget: int = 64):
    """Two requests past their prompts (4 tokens each, 3 computed) in blocks of 4."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), CacheConfig(block_size=4), num_blocks,
                      VirtualClock(), max_model_len=64)
    sched.speculative = True
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=20, ignore_eos=True), 0.0))
    out = sched.schedule()
    sched.update(out, StepResult(sampled={"a": 9, "b": 9}))
    return sched


def test_proposals_ride_in_the_decode_chunk_and_count_against_the_budget():
    sched = running_pair(num_blocks=8, budget=5)
    a, b = sched.requests["a"], sched.requests["b"]
    a.spec_token_ids, b.spec_token_ids = [7, 8, 9], [7, 8, 9]
    chunks = {c.request.request_id: c for c in sched.schedule().chunks}
    assert (chunks["a"].num_tokens, chunks["a"].num_spec_tokens) == (4, 3)
    assert (chunks["b"].num_tokens, chunks["b"].num_spec_tokens) == (1, 0)  # one token of budget was left
    assert not chunks["a"].is_prefill and not chunks["b"].is_prefill


def test_accepted_tokens_advance_the_request_and_stop_at_its_limit():
    sched = running_pair(num_blocks=8)
    a = sched.requests["a"]
    a.spec_token_ids = [7, 8, 9]
    out = sched.schedule()
    sched.update(out, StepResult(sampled={"a": 7, "b": 5}, spec_tokens={"a": [7, 8, 4]}))
    assert a.output_token_ids == [9, 7, 8, 4] and a.num_computed_tokens == 6 and a.num_tokens == 7
    a.sampling_params.max_tokens = 5
    a._output_limit = None
    a.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    sched.update(out, StepResult(sampled={"a": 1, "b": 5}, spec_tokens={"a": [1, 2, 3, 6]}))
    assert a.output_token_ids == [9, 7, 8, 4, 1] and a.status is RequestStatus.FINISHED_LENGTH


def test_proposals_never_preempt_another_request():
    sched = running_pair(num_blocks=2)  # one block each, none free: the proposals do not fit
    for req in sched.running:
        req.spec_token_ids = [7, 8]
    out = sched.schedule()
    assert [c.num_spec_tokens for c in out.chunks] == [0, 0] and len(out.chunks) == 2
    assert sched.num_preemptions_total == 0
    sched = running_pair(num_blocks=3)  # one free block: the first decode gets its proposals, nobody is evicted
    for req in sched.running:
        req.spec_token_ids = [7, 8]
    out = sched.schedule()
    assert [c.num_spec_tokens for c in out.chunks] == [2, 0] and sched.num_preemptions_total == 0
