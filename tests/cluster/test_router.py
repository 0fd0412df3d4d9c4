"""Algorithm 1 at each of its three boundaries, rolling activation order, pending FIFO."""
import pytest

from ecoserve.cluster import InstanceStatus, MacroInstance, RequestState, RouterConfig


def ms_per_token(n: int) -> float:  # predicted prefill: 1 ms per prompt token
    return n / 1000


def status(iid=0, window=(), decoding=(), free=100_000, total=100_000, t_switch=10.0, now=10.5):
    reqs = [RequestState(f"w{i}", t_switch + 0.1, n, None, 0) for i, n in enumerate(window)]
    reqs += [RequestState(f"d{i}", 0.0, 100, ft, tok) for i, (tok, ft) in enumerate(decoding)]
    return InstanceStatus(iid, now, "decode", t_switch, tuple(reqs), free, total)


def router(**kw):
    cfg = dict(ttft_slo=1.0, tpot_slo=0.1, kv_reserve_frac=0.05)
    cfg.update(kw)
    return MacroInstance([0], ms_per_token, RouterConfig(**cfg))


def test_check1_window_prefill_time_within_ttft_slo():
    r = router()
    st = status(window=[400])
    assert r.check(st, 600, now=10.5).ok  # 0.4 + 0.6 = 1.0 s == S_TTFT: satisfied
    c = r.check(st, 601, now=10.5)
    assert (c.ok, c.reason) == (False, "ttft") and c.window_prefill_time == pytest.approx(1.001)


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


def test_requests_routed_before_switch_are_decoding_not_window():
    r = router()
    st = status(window=[900], decoding=[(50, 10.0)])
    assert r.check(st, 100, now=10.5).ok  # 0.9 + 0.1 = 1.0
    assert not r.check(st, 101, now=10.5).ok


def _fleet(ok_ids, n=4):
    """Statuses where only instances in ok_ids can take a 100-token prompt."""
    def status_of(iid):
        return status(iid, window=[] if iid in ok_ids else [950])
    return status_of


def test_rolling_activation_tries_previous_instance_first_then_cycles():
    r = MacroInstance([0, 1, 2, 3], ms_per_token, RouterConfig(1.0, 0.1))
    assert r.candidate_order() == [0, 1, 2, 3]
    assert r.try_route(100, _fleet({2}), now=10.5) == 2
    assert r.candidate_order() == [2, 3, 0, 1]  # the previous request's instance first
    assert r.try_route(100, _fleet({1, 2}), now=10.5) == 2
    assert r.try_route(100, _fleet({0, 1}), now=10.5) == 0  # 2 fails, 3 fails, wraps to 0
    assert r.candidate_order() == [0, 1, 2, 3]


def test_random_order_ablation_keeps_previous_first_and_visits_all():
    r = MacroInstance([0, 1, 2, 3, 4], ms_per_token, RouterConfig(1.0, 0.1, order="random", seed=3))
    r.try_route(100, _fleet({3}), now=10.5)
    order = r.candidate_order()
    assert order[0] == 3 and sorted(order) == [0, 1, 2, 3, 4]


def test_requests_that_fit_nowhere_wait_fifo_and_go_when_room_appears():
    r = MacroInstance([0, 1], ms_per_token, RouterConfig(1.0, 0.1))
    assert r.submit("a", 200, _fleet(set()), now=10.5) == []
    tight = lambda iid: status(iid, window=[850])  # 0.85 s queued: a 100-token prompt fits, 200 does not
    assert r.submit("b", 100, tight, now=10.5) == []  # head "a" blocks: no overtaking
    assert [p.request_id for p in r.pending] == ["a", "b"]
    out = r.retry(lambda iid: status(iid), now=11.0)
    assert out == [("a", 0), ("b", 0)] and not r.pending


def test_fixed_interval_ablation_sends_batches_to_the_next_instance():
    r = MacroInstance([0, 1, 2], ms_per_token, RouterConfig(1.0, 0.1, mode="fixed_interval", interval_frac=0.25))
    assert r.interval == 0.25
    for rid in "abc":
        assert r.submit(rid, 100, _fleet({0, 1, 2}), now=10.5) == []
    assert r.interval_tick(lambda iid: status(iid), now=10.75) == [("a", 1), ("b", 1), ("c", 1)]


def test_membership_changes_keep_cycle_valid():
    r = MacroInstance([0, 1, 2], ms_per_token, RouterConfig(1.0, 0.1))
    r.try_route(100, _fleet({2}), now=10.5)
    r.remove_instance(2)
    assert 2 not in r.candidate_order() and len(r.candidate_order()) == 2
    r.add_instance(7)
    assert sorted(r.instances) == [0, 1, 7]


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="slack"):
        RouterConfig(1.0, 0.1, slack="median")


def test_phase_slack_counts_only_since_the_last_switch():
    r = router(ttft_slo=2.0, slack="phase")
    # t_switch 10.0, now 10.5. Request a: first token at 2.0, 100 tokens, 95 of them before the switch:
    # phase slack 5*0.1 - (10.5 - 10.0) = 0.0 (its lifetime slack would be 100*0.1 - 8.5 = 1.5).
    # Request b: first token at 10.2 (after the switch), 3 tokens: 3*0.1 - (10.5 - 10.2) = 0.0 either way.
    reqs = (RequestState("a", 0.0, 100, 2.0, 100, 95), RequestState("b", 0.0, 100, 10.2, 3, 0))
    st = InstanceStatus(0, 10.5, "decode", 10.0, reqs, 100_000, 100_000)
    assert r.saved_tpot(st, 10.5) == pytest.approx(0.0)
    assert router(ttft_slo=2.0).saved_tpot(st, 10.5) == pytest.approx((1.5 + 0.0) / 2)
    c = r.check(st, 1, now=10.5)
    assert (c.ok, c.reason) == (False, "tpot")  # no slack banked in this phase: roll to the next instance
