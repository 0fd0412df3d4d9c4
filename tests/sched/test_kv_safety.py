"""Nobody reads KV that was never written (prefix hits + preemption), and the one prefill rule holds."""
import random

import pytest

from ecoserve.clock import VirtualClock
from ecoserve.config import CacheConfig, SchedulerConfig
from ecoserve.request import Request
from ecoserve.sampling import SamplingParams
from ecoserve.sched import Scheduler, StepResult
from ecoserve.sched.interface import is_prefill
from ecoserve.sched.policy import Policy
from ecoserve.sched.step import decoding, next_is_prefill, prefilling

BS = 4


def make(policy="chunked", blocks=30, budget=16):
    clock = VirtualClock()
    sched = Scheduler(SchedulerConfig(policy=policy, max_num_batched_tokens=budget, max_num_seqs=64),
                      CacheConfig(block_size=BS, enable_prefix_caching=True), blocks, clock, max_model_len=400)
    return sched, clock


class KVChecker:
    """A fake executor that writes each scheduled token's KV (its whole prefix, which is what KV depends on)
    into its slot, then checks every slot a chunk attends to holds this request's prefix."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def execute(self, out) -> None:
        for c in out.chunks:
            table, tokens = out.block_tables[c.request.request_id], c.request.all_token_ids
            for p in range(c.start, c.start + c.num_tokens):
                self.slots[(table[p // BS], p % BS)] = tuple(tokens[:p + 1])
        for c in out.chunks:
            table, tokens = out.block_tables[c.request.request_id], c.request.all_token_ids
            for p in range(c.start + c.num_tokens):
                assert self.slots.get((table[p // BS], p % BS)) == tuple(tokens[:p + 1]), \
                    f"{c.request.request_id} reads position {p}, which nobody wrote"


@pytest.mark.parametrize("policy", ["chunked", "prefill_first"])
@pytest.mark.parametrize("seed", range(20))
def test_prefix_hits_under_preemption_read_only_written_kv(policy, seed):
    rng = random.Random(seed)
    sched, clock = make(policy)
    shared = [rng.randrange(2) for _ in range(24)]
    for i in range(20):
        prompt = shared[:rng.choice([8, 16, 24])] + [rng.randrange(5) for _ in range(rng.randint(1, 30))]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True),
                                  0.0))
    checker, steps = KVChecker(), 0
    while sched.has_unfinished_requests():
        running = list(sched.running)
        assert prefilling(running) == [r for r in running if is_prefill(r.num_tokens - r.num_computed_tokens, True)]
        assert prefilling(running) == [r for r in running if next_is_prefill(r)]
        assert decoding(running) == [r for r in running if r not in prefilling(running)]
        out = sched.schedule()
        assert out.chunks
        assert sched.phase == ("prefill" if any(c.is_prefill for c in out.chunks) else "decode")
        checker.execute(out)
        clock.advance_to(clock.now() + 0.01)
        sched.update(out, StepResult(sampled={c.request.request_id: rng.randrange(5)
                                              for c in out.chunks if c.samples}))
        steps += 1
    assert sched.num_preemptions_total > 0 and sched.kv.prefix_hits > 0


class AdmitThenPreempt(Policy):
    """A broken policy: admits a request that hits another's fresh blocks, then preempts that other."""

    def schedule(self, sched, step) -> None:
        first, second = list(sched.waiting)[:2]
        assert sched.admit(first, step) and sched.admit(second, step)
        sched.preempt(first, step)


def test_preempting_a_request_whose_fresh_blocks_were_hit_is_refused():
    sched, _ = make(budget=64)
    prompt = list(range(20))
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=4), 0.0))
    sched.add_request(Request("b", prompt + [7], SamplingParams(max_tokens=4), 0.0))
    sched.policy = AdmitThenPreempt()
    with pytest.raises(AssertionError, match="share its not yet computed blocks"):
        sched.schedule()


def test_is_prefill_rule():
    assert not is_prefill(1, True)  # a decode: the newest token, then a sample
    assert is_prefill(1, False) and is_prefill(5, True) and is_prefill(5, False)
