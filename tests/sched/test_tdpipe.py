"""The `tdpipe` policy: hand-computed cases on the authors' L20 Llama-2-13B profile, then the policy in virtual time.

Profile rows used (ms): T(10)=37.69, T(11)=37.67, T(64)=43.89, T(128)=47.77, T(150)=60.20,
T(256)=69.98, T(500)=131.58, T(2048)=508.74.
"""
import random

import pytest

from ecoserve.clock import VirtualClock
from ecoserve.config import CacheConfig, SchedulerConfig, TDPipeConfig
from ecoserve.request import Request, RequestStatus
from ecoserve.sampling import SamplingParams
from ecoserve.sched import Scheduler, StepResult
from ecoserve.sched.predictors import BucketMeans, FixedLength, OracleWithNoise, make_predictor
from ecoserve.sched.tdpipe import DEFAULT_PROFILE, Profile, decode_to_prefill, kv_usage, microbatch_size


@pytest.fixture(scope="module")
def profile():
    return Profile.from_csv(DEFAULT_PROFILE)


def test_intensity_and_truncated_times(profile):
    # (64 / 43.89) / (256 / 69.98) = 1.4580 / 3.6584
    assert round(profile.intensity(64), 3) == 0.399
    assert round(profile.intensity(128), 3) == 0.732
    assert profile.intensity(192) == profile.intensity(256) == profile.intensity(1000) == 1.0
    assert profile.intensity(191) < 1.0
    assert profile.time_ms(64) == 43 and profile.time_ms(500) == 131
    assert profile.time_ms(4096) == 1017  # past the table: 508.74 * 4096 / 2048, truncated


def test_kv_usage_horizons():
    # (current length, predicted remaining): one finishing within 10 tokens, one with 600 to go; 16-token blocks
    usage = kv_usage([(100, 10), (30, 600)], 16)
    assert usage[5] == 7 + 3 and usage[8] == 7 + 3  # ceil(105/16) + ceil(35/16), ceil(108/16) + ceil(38/16)
    assert usage[16] == 3 and usage[32] == 4 and usage[64] == 6  # the first has freed its blocks
    assert usage[128] == 10 and usage[256] == 18 and usage[512] == 34
    assert usage[1024] == usage[2048] == usage[4096] == 0


def test_work_stealing_sizes():
    assert [microbatch_size(10, 4, k) for k in range(8)] == [3, 3, 2, 2, 3, 3, 2, 2]
    assert [microbatch_size(7, 2, k) for k in range(2)] == [4, 3]
    assert microbatch_size(3, 4, 3) == 0


def test_switch_when_the_decode_batch_has_shrunk(profile):
    # pp=4, 40 running -> B_d = 10: decode intensity (10/37.69)/(256/69.98) = 0.0725.
    # Four 500-token prompts (T=131 each): prefill 4*131/4 + 131/4*3 = 229.25 ms; decode batch 44//4 = 11 (T=37):
    # bubble (32.75 - 37) * 3 = -12.75; prefill intensity (229.25 + 12.75) / 229.25 = 1.0556.
    d = decode_to_prefill([(200, 50)] * 40, [(500, 100)] * 4, 10_000, 16, 4, profile)
    assert round(d.decode_intensity, 4) == 0.0725 and round(d.prefill_intensity, 4) == 1.0556 and d.switch


def test_no_switch_while_decode_is_efficient(profile):
    # pp=4, 600 running -> B_d = 150: (150/60.20)/(256/69.98) = 0.6811. One 2048-token prompt (T=508):
    # prefill 508/4 + 508/4*3 = 508; decode batch 601//4 = 150 (T=60); bubble (127 - 60) * 3 = 201;
    # prefill intensity (508 - 201) / 508 = 0.6043 < 0.6811.
    d = decode_to_prefill([(300, 100)] * 600, [(2048, 100)], 1_000_000, 16, 4, profile)
    assert round(d.decode_intensity, 4) == 0.6811 and round(d.prefill_intensity, 4) == 0.6043 and not d.switch


def test_switch_not_evaluated_for_a_saturated_batch_or_without_room(profile):
    assert decode_to_prefill([(10, 10)] * 4 * 193, [(100, 10)], 10**6, 16, 4, profile) is None
    # KV already beyond every block: nothing could be admitted, so the prefill phase has no value
    d = decode_to_prefill([(1000, 1000)] * 8, [(100, 10)], 10, 16, 4, profile)
    assert d.prefill_intensity == 0.0 and not d.switch


def test_predictors():
    req = Request("a", [1] * 10, SamplingParams(max_tokens=300, ignore_eos=True), 0.0)
    assert OracleWithNoise().predict(req) == 300
    noisy = [OracleWithNoise(noise=0.2, seed=s).predict(req) for s in range(50)]
    assert len(set(noisy)) > 10 and 200 < sum(noisy) / 50 < 400
    buckets = BucketMeans.from_lengths([10, 30, 100, 200, 280, 290, 1000], boundaries=(42, 141, 294, 503))
    assert buckets.predict(req) == 294  # 300 is in [294, 503), which no sample fell in: its lower edge
    mid = Request("b", [1], SamplingParams(max_tokens=250, ignore_eos=True), 0.0)
    assert buckets.predict(mid) == round((200 + 280 + 290) / 3)  # [141, 294)
    assert FixedLength(64).predict(req) == 64 and make_predictor("constant", length=5).predict(req) == 5
    with pytest.raises(ValueError, match="unknown output-length predictor"):
        make_predictor("bert")


def make(stages=2, blocks=400, budget=512, predictor="oracle"):
    clock = VirtualClock()
    cfg = SchedulerConfig(policy="tdpipe", max_num_batched_tokens=budget,
                          tdpipe=TDPipeConfig(num_stages=stages, predictor=predictor))
    return Scheduler(cfg, CacheConfig(block_size=16), blocks, clock, max_model_len=2048), clock


def add(sched, n, seed=0):
    rng = random.Random(seed)
    for i in range(n):
        sched.add_request(Request(f"r{i}", [rng.randrange(500) for _ in range(rng.randint(20, 120))],
                                  SamplingParams(max_tokens=rng.randint(2, 60), ignore_eos=True), 0.0))


def drain(sched, clock, in_flight=1, check=None):
    """Run to completion with up to `in_flight` batches scheduled before the oldest is updated."""
    queue, steps = [], 0
    while sched.has_unfinished_requests() or queue:
        while len(queue) < in_flight and sched.has_unfinished_requests():
            out = sched.schedule()
            if out.is_empty:
                break
            if check:
                check(sched, out, queue)
            queue.append(out)
        assert queue, "stalled with work pending"
        out = queue.pop(0)
        clock.advance_to(clock.now() + 0.01)
        sched.update(out, StepResult(sampled={c.request.request_id: 7 for c in out.chunks if c.samples}))
        steps += 1
        assert steps < 20_000
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_phases_prefill_microbatches_and_work_stealing():
    sched, clock = make(stages=2)
    add(sched, 12)
    kinds = []

    def check(s, out, queue):
        kinds.append("p" if any(c.is_prefill for c in out.chunks) else "d")
        if any(c.is_prefill for c in out.chunks) and len(out.chunks) > 1:  # grows only until n_seqs * max_len >= 192
            lens = [c.num_tokens for c in out.chunks]
            assert (len(lens) - 1) * max(lens[:-1]) < 192
        if not any(c.is_prefill for c in out.chunks):
            n = len(s.running)
            assert len(out.chunks) <= n // 2 + 1 + 2  # the work-stealing size, plus the absorbed tail

    drain(sched, clock, check=check)
    first_decode = kinds.index("d")
    assert first_decode > 1 and set(kinds[:first_decode]) == {"p"}  # one long prefill phase first


def test_two_batches_in_flight_never_share_a_request():
    # predicted lengths far too short and a tight pool: admission overcommits, so preemption must happen,
    # and never of a request in flight
    sched, clock = make(stages=2, blocks=60, predictor=FixedLength(2))

    def check(s, out, queue):
        ids = {c.request.request_id for c in out.chunks}
        for other in queue:
            assert not ids & {c.request.request_id for c in other.chunks}
            assert all(c.request.status is RequestStatus.RUNNING for c in other.chunks)

    add(sched, 16, seed=2)
    drain(sched, clock, in_flight=2, check=check)
    assert sched.num_preemptions_total > 0


def test_decode_phase_with_nothing_left_to_decode_returns_to_prefill():
    # the decode phase drained every running request in the middle of a round of pp micro-batches (the switch
    # is evaluated only every pp of them) while prompts wait: the next schedule must prefill, not stall
    sched, clock = make(stages=2)
    add(sched, 3)
    policy = sched.policy
    policy.prefill_mode, policy.decode_count = False, 1
    out = sched.schedule()
    assert any(c.is_prefill for c in out.chunks) and policy.prefill_mode
    sched.update(out, StepResult(sampled={c.request.request_id: 7 for c in out.chunks if c.samples}))
    drain(sched, clock, in_flight=2)
