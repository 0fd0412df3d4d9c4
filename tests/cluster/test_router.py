"""Algorithm 1, paper mode, at each boundary (hand-computed); rolling activation; router-owned windows."""
import pytest

from ecoserve.cluster import InstanceStatus, MacroInstance, PrefillProfile, RequestState, RouterConfig
from ecoserve.cluster.events import CloseWindow, Dispatch, HoldOutput, OpenWindow, ReleaseOutput, SetTimer

PROFILE = PrefillProfile(lambda n: n / 1000, 4096)  # 1 ms per prompt token, batched or not


def status(iid=0, queued=(), decoding=(), free=100_000, total=100_000, now=10.5, running=0, seats=256):
    """`queued`: prompt lengths not yet prefilled; `decoding`: (tokens, first token time), routed at t=0."""
    reqs = [RequestState(f"q{i}", 10.1, n, None, 0) for i, n in enumerate(queued)]
    reqs += [RequestState(f"d{i}", 0.0, 100, ft, tok) for i, (tok, ft) in enumerate(decoding)]
    return InstanceStatus(iid, now, "decode", 0.0, tuple(reqs), free, total, num_running=running or len(reqs),
                          max_num_seqs=seats)


def router(ids=(0,), **kw):
    cfg = dict(ttft_slo=1.0, tpot_slo=0.1, kv_reserve_frac=0.05)
    cfg.update(kw)
    return MacroInstance(list(ids), PROFILE, RouterConfig(**cfg))


def test_check1_batched_window_within_ttft_slo():
    r = router()
    st = status(queued=[400])
    assert r.check(st, 600, now=10.5).ok  # 0.4 + 0.6 = 1.0 s == S_TTFT: satisfied
    c = r.check(st, 601, now=10.5)
    assert (c.ok, c.reason) == (False, "ttft") and c.window_prefill_time == pytest.approx(1.001)


def test_check1_counts_how_long_the_window_is_open_and_the_router_wait():
    r = router()
    r.switch_to(0, now=10.25)  # the window opened 0.25 s ago
    st = status(queued=[100])
    assert r.check(st, 650, now=10.5).ok  # 0.25 + 0.1 + 0.65 = 1.0
    assert r.check(st, 651, now=10.5).reason == "ttft"
    other = router()  # no window open: the request's own router wait counts instead
    assert other.check(status(queued=[100]), 650, now=10.5, queued_time=10.25).ok
    assert other.check(status(queued=[100]), 651, now=10.5, queued_time=10.25).reason == "ttft"


def test_check1_lets_late_requests_go_to_an_empty_instance():
    r = router()
    assert r.check(status(), 900, now=10.5, queued_time=5.0).ok  # waited 5.5 s: late, the window alone counts
    assert r.check(status(), 2000, now=10.5).ok  # longer than S_TTFT, but nothing else is queued there


def test_check2_mean_saved_tpot_covers_window():
    r = router(ttft_slo=2.0)
    # saved = tokens * 0.1 - (now - first_token): 10*0.1 - 0.5 = 0.5 and 20*0.1 - 0.5 = 1.5; mean 1.0
    st = status(decoding=[(10, 10.0), (20, 10.0)])
    assert r.saved_tpot(st, 10.5) == pytest.approx(1.0)
    assert r.check(st, 1000, now=10.5).ok
    c = r.check(st, 1001, now=10.5)
    assert (c.ok, c.reason) == (False, "tpot")


def test_check2_min_slack_ablation():
    r = router(ttft_slo=2.0, slack="min")
    st = status(decoding=[(10, 10.0), (20, 10.0)])
    assert r.check(st, 500, now=10.5).ok
    assert r.check(st, 501, now=10.5).reason == "tpot"


def test_check2_passes_without_decoding_requests():
    assert router().check(status(), 900, now=10.5).ok


def test_check3_memory_with_reserve():
    r = router()
    st = status(free=1000, total=10_000)  # 5% of 10,000 reserved: 500 tokens usable
    assert r.check(st, 499, now=10.5).ok  # prompt + 1 token = 500
    c = r.check(st, 500, now=10.5)
    assert (c.ok, c.reason) == (False, "memory")


def test_check4_seats():
    r = router()
    assert r.check(status(running=3, seats=4), 10, now=10.5).ok
    assert r.check(status(running=4, seats=4), 10, now=10.5).reason == "seats"


def test_window_requests_are_not_decoding():
    r = router(ttft_slo=2.0)
    r.switch_to(0, now=10.0)
    # "w" was routed in the window (10.1 >= 10.0) and decodes already: it is not check (2)'s slack.
    reqs = (RequestState("w", 10.1, 100, 10.2, 1), RequestState("d", 0.0, 100, 10.0, 10))
    st = InstanceStatus(0, 10.5, "decode", 10.0, reqs, 100_000, 100_000, num_running=2)
    assert r.saved_tpot(st, 10.5) == pytest.approx(10 * 0.1 - 0.5)


def no_timers(acts):
    return [a for a in acts if not isinstance(a, SetTimer)]


def _fleet(ok_ids):
    """Statuses where only instances in ok_ids can take a 100-token prompt."""
    return lambda iid: status(iid, queued=[] if iid in ok_ids else [950])


def test_rolling_activation_tries_previous_instance_first_then_cycles():
    r = router([0, 1, 2, 3])
    req = lambda: r.pending[0] if r.pending else None
    assert r.candidate_order() == [0, 1, 2, 3]
    acts = r.submit("a", 100, 5, _fleet({2}), now=10.5)
    assert no_timers(acts) == [OpenWindow(2), Dispatch("a", 2, 5)] and r.active == 2
    assert r.candidate_order() == [2, 3, 0, 1]  # the previous request's instance first
    assert r.submit("b", 100, 5, _fleet({1, 2}), now=10.5) == [Dispatch("b", 2, 5)]  # window already open
    acts = r.submit("c", 100, 5, _fleet({0, 1}), now=10.5)
    assert no_timers(acts) == [CloseWindow(2), OpenWindow(0), Dispatch("c", 0, 5)]
    assert req() is None


def test_random_order_ablation_keeps_previous_first_and_visits_all():
    r = router([0, 1, 2, 3, 4], order="random", seed=3)
    r.submit("a", 100, 1, _fleet({3}), now=10.5)
    order = r.candidate_order()
    assert order[0] == 3 and sorted(order) == [0, 1, 2, 3, 4]


def test_requests_that_fit_nowhere_wait_fifo_and_go_when_room_appears():
    r = router([0, 1])
    assert r.submit("a", 200, 1, _fleet(set()), now=10.5) == []
    tight = lambda iid: status(iid, queued=[850])  # 0.85 s queued: a 100-token prompt fits, 200 does not
    assert r.submit("b", 100, 1, tight, now=10.5) == []  # head "a" blocks: no overtaking
    assert [p.request_id for p in r.pending] == ["a", "b"]
    out = r.retry(lambda iid: status(iid), now=10.6)
    assert [a for a in out if isinstance(a, Dispatch)] == [Dispatch("a", 0, 1), Dispatch("b", 0, 1)]
    assert not r.pending


def test_output_hold_follows_the_window_and_its_timer():
    r = router([0, 1], output_hold=True)
    acts = r.submit("a", 100, 1, _fleet({0}), now=10.5)
    assert no_timers(acts)[:2] == [OpenWindow(0), HoldOutput(0)]
    release, close = sorted((a for a in acts if isinstance(a, SetTimer)), key=lambda a: a.name, reverse=True)
    assert release.time == close.time == pytest.approx(11.5) and release.name.startswith("release/")
    assert r.on_timer(release.name) == [ReleaseOutput(0)]  # S_TTFT after the open
    assert r.on_timer(release.name) == []
    assert r.on_timer(close.name) == [CloseWindow(0)] and r.active is None  # paper mode: closed on time
    assert r.candidate_order()[0] == 1  # the cursor moved on
    acts = r.submit("b", 100, 1, _fleet({1}), now=12.0)
    assert no_timers(acts)[:2] == [OpenWindow(1), HoldOutput(1)]
    acts = r.submit("c", 100, 1, _fleet({0}), now=12.2)
    assert no_timers(acts)[:2] == [CloseWindow(1), ReleaseOutput(1)]  # released at the close


def test_fixed_interval_ablation_sends_batches_to_the_next_instance():
    r = router([0, 1, 2], mode="fixed_interval", interval_frac=0.25)
    assert r.mode.period(r.config) == 0.25
    for rid in "abc":
        assert r.submit(rid, 100, 1, _fleet({0, 1, 2}), now=10.5) == []
    assert no_timers(r.tick(lambda iid: status(iid), now=10.75)) == [OpenWindow(1)] + [
        Dispatch(x, 1, 1) for x in "abc"]


def test_membership_changes_keep_cycle_valid():
    r = router([0, 1, 2])
    r.submit("a", 100, 1, _fleet({2}), now=10.5)
    assert r.remove_instance(2) == [CloseWindow(2)] and r.active is None
    assert 2 not in r.candidate_order() and len(r.candidate_order()) == 2
    r.add_instance(7)
    assert sorted(r.instances) == [0, 1, 7]


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="slack"):
        RouterConfig(1.0, 0.1, slack="median")
    with pytest.raises(ValueError, match="router mode"):
        RouterConfig(1.0, 0.1, mode="algorithm2")


def test_phase_slack_counts_only_since_the_window_opened():
    r = router(ttft_slo=2.0, slack="phase")
    # window (t_switch) 10.0, now 10.5. Request a: first token at 2.0, 100 tokens, 95 of them before the open:
    # phase slack 5*0.1 - (10.5 - 10.0) = 0.0 (its lifetime slack would be 100*0.1 - 8.5 = 1.5).
    # Request b: first token at 10.2 (after the open), 3 tokens: 3*0.1 - (10.5 - 10.2) = 0.0 either way.
    reqs = (RequestState("a", 0.0, 100, 2.0, 100, 95), RequestState("b", 0.0, 100, 10.2, 3, 0))
    st = InstanceStatus(0, 10.5, "decode", 10.0, reqs, 100_000, 100_000)
    assert r.saved_tpot(st, 10.5) == pytest.approx(0.0)
    assert router(ttft_slo=2.0).saved_tpot(st, 10.5) == pytest.approx((1.5 + 0.0) / 2)
    c = r.check(st, 1, now=10.5)
    assert (c.ok, c.reason) == (False, "tpot")  # no slack banked in this window: roll to the next instance


def test_profile_batches_a_window():
    p = PrefillProfile(lambda n: 0.02 + n / 1000, 512)
    assert p.batched(0) == 0.0
    assert p.batched(100) == pytest.approx(0.12)  # one step, not a sum of single prefills
    assert p.batched(1100) == pytest.approx(2 * 0.532 + 0.096)  # two full 512-token steps and 76 tokens
