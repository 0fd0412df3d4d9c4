"""The token-budget mechanism and its policies, driven in virtual time with a fake executor."""
import random

import pytest

from ecoserve.clock import VirtualClock
from ecoserve.config import CacheConfig, SchedulerConfig
from ecoserve.request import Request, RequestStatus
from ecoserve.sampling import SamplingParams
from ecoserve.cluster.status import instance_status
from ecoserve.sched import Scheduler, StepResult


def make(policy="chunked", budget=64, blocks=64, block_size=4, max_seqs=256, max_len=200):
    clock = VirtualClock()
    sched = Scheduler(SchedulerConfig(policy=policy, max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                      CacheConfig(block_size=block_size), blocks, clock, max_model_len=max_len)
    return sched, clock


def add_random(sched, n, seed=0, vocab=3):
    rng = random.Random(seed)
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 80))]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True), 0.0))


def run(sched, clock, check=None, max_steps=10_000):
    finished, steps = [], 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert out.chunks, "scheduler stalled with work pending"
        if check:
            check(sched, out)
        clock.advance_to(clock.now() + 0.01)
        finished += sched.update(out, StepResult(sampled={c.request.request_id: 7 for c in out.chunks if c.samples}))
        steps += 1
        assert steps < max_steps
    return finished


@pytest.mark.parametrize("policy", ["prefill_first", "chunked", "temporal"])
def test_every_request_finishes_with_its_tokens_and_no_kv_leaks(policy):
    sched, clock = make(policy, blocks=40)  # tight: forces preemptions
    add_random(sched, 20)

    def check(s, out):
        assert sum(c.num_tokens for c in out.chunks) <= s.config.max_num_batched_tokens
        assert len(out.chunks) <= s.config.max_num_seqs
        for c in out.chunks:
            assert c.start == c.request.num_computed_tokens
            assert c.start + c.num_tokens <= c.request.num_tokens
            assert len(out.block_tables[c.request.request_id]) * 4 >= c.start + c.num_tokens

    finished = run(sched, clock, check)
    assert len(finished) == 20
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in finished)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in finished)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.num_preemptions_total > 0
    assert sum(r.num_preemptions for r in finished) == sched.num_preemptions_total


def test_prefill_first_never_mixes_prefill_and_decode():
    sched, clock = make("prefill_first", budget=100, blocks=200)
    add_random(sched, 12, seed=1)
    kinds = []

    def check(s, out):
        mixed = {c.is_prefill for c in out.chunks}
        assert len(mixed) == 1
        kinds.append(mixed.pop())

    run(sched, clock, check)
    assert True in kinds and False in kinds


def test_chunked_puts_decodes_first_and_chunks_long_prompts():
    sched, clock = make("chunked", budget=16, blocks=200)
    sched.add_request(Request("a", [1] * 5, SamplingParams(max_tokens=10, ignore_eos=True), 0.0))
    out = sched.schedule(); clock.advance_to(1)
    sched.update(out, StepResult(sampled={"a": 7}))
    sched.add_request(Request("b", [2] * 50, SamplingParams(max_tokens=3, ignore_eos=True), 1.0))
    out = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 15)]
    assert not out.chunks[1].samples and out.chunks[0].samples


def test_max_num_seqs_limits_running_requests():
    sched, clock = make("chunked", budget=1000, blocks=500, max_seqs=3)
    add_random(sched, 10, seed=2)
    run(sched, clock, lambda s, out: (len(s.running) <= 3) or pytest.fail("too many running"))


def test_preemption_takes_the_newest_request():
    sched, clock = make("chunked", budget=100, blocks=6, block_size=4, max_len=24)
    sched.add_request(Request("old", [1] * 8, SamplingParams(max_tokens=12, ignore_eos=True), 0.0))
    sched.add_request(Request("new", [2] * 8, SamplingParams(max_tokens=12, ignore_eos=True), 1.0))
    preempted = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        preempted += [r.request_id for r in sched.waiting if r.status == RequestStatus.PREEMPTED]
        clock.advance_to(clock.now() + 1)
        sched.update(out, StepResult(sampled={c.request.request_id: 7 for c in out.chunks if c.samples}))
    assert preempted and set(preempted) == {"new"}


def test_bad_requests_are_rejected_without_disturbing_others():
    sched, clock = make(max_len=50)
    sched.add_request(Request("ok", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), 0.0))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("long", [1] * 51, SamplingParams(), 0.0))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("empty", [], SamplingParams(), 0.0))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(Request("ok", [1], SamplingParams(), 0.0))
    assert [r.request_id for r in run(sched, clock)] == ["ok"]


def test_abort_frees_blocks_and_reports_status():
    sched, clock = make(blocks=50)
    add_random(sched, 5, seed=3)
    out = sched.schedule(); clock.advance_to(0.5)
    sched.update(out, StepResult(sampled={c.request.request_id: 7 for c in out.chunks if c.samples}))
    status = instance_status(0, sched)
    assert status.num_running + status.num_waiting == 5 and status.phase == "prefill"
    assert {p.request_id for p in status.requests} == {f"r{i}" for i in range(5)}
    sched.abort_requests([f"r{i}" for i in range(5)])
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == 50
    assert sched.schedule().is_empty and sched.schedule().finished_ids == ()  # kept for a batch that runs
    assert set(sched.take_finished_ids()) == {f"r{i}" for i in range(5)} and not sched.take_finished_ids()


def test_finished_ids_survive_empty_steps():
    """An id that finished is handed to the executor with the next batch that runs, even after empty steps."""
    sched, clock = make(blocks=50)
    sched.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True), 0.0))
    run(sched, clock)
    assert sched.schedule().is_empty and sched.schedule().is_empty  # nothing to run: the id stays
    sched.add_request(Request("b", [1, 2], SamplingParams(max_tokens=1, ignore_eos=True), 1.0))
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["b"] and out.finished_ids == ("a",)


def test_prefix_cache_hits_skip_computed_tokens():
    sched, clock = make(blocks=100)
    shared = list(range(3)) * 8  # 24 tokens = 6 full blocks
    sched.add_request(Request("a", shared + [1], SamplingParams(max_tokens=1, ignore_eos=True), 0.0))
    run(sched, clock)
    sched.add_request(Request("b", shared + [2, 2], SamplingParams(max_tokens=1, ignore_eos=True), 1.0))
    out = sched.schedule()
    assert out.chunks[0].start == 24 and out.chunks[0].num_tokens == 2


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make("nope")
