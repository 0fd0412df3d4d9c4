"""Whole-cluster simulations through the live scheduler: nothing lost, deterministic, definitions hold."""
import pytest

from ecoserve.cluster.events import Dispatch, HoldOutput, ReleaseOutput, Scale, TimerFired
from ecoserve.sim.cluster import ClusterSpec
from ecoserve.sim.network import LinkQueue
from ecoserve.sim.hardware import link
from ecoserve.sim.cluster import STRATEGIES, build
from ecoserve.sim.events import Timer
from ecoserve.sim.workload import SimRequest, rate_schedule, synthetic


def small_spec(**kw):
    return ClusterSpec(model="llama-3-8b", gpu="L20", tp=1, num_instances=4, **kw)


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_every_request_finishes_once(name):
    wl = synthetic("sharegpt", 6.0, 150, seed=2)
    res = build(name, small_spec(), 5.0, 0.1).run(wl)
    assert sorted(r.request_id for r in res.records) == sorted(r.request_id for r in wl)
    for r in res.records:
        assert r.arrival <= r.first_token <= r.decode_start <= r.finish


@pytest.mark.parametrize("mode,router", [("fixed_interval", {"interval_frac": 0.5}), ("paper", {"order": "random"}),
                                         ("paper", {"slack": "min"})])
def test_ablation_variants_finish_every_request(mode, router):
    wl = synthetic("sharegpt", 6.0, 120, seed=3)
    res = build("ecoserve", small_spec(), 5.0, 0.1, router_mode=mode, router=router).run(wl)
    assert sorted(r.request_id for r in res.records) == sorted(r.request_id for r in wl)


def test_simulation_is_deterministic():
    wl = synthetic("alpaca", 10.0, 100, seed=4)
    a = build("ecoserve", small_spec(), 1.0, 0.1).run(wl).records
    b = build("ecoserve", small_spec(), 1.0, 0.1).run(wl).records
    assert [(r.request_id, r.finish) for r in a] == [(r.request_id, r.finish) for r in b]


def test_mitosis_loses_nothing_and_drained_instances_get_nothing_new():
    wl = rate_schedule("alpaca", [(4.0, 20.0), (150.0, 20.0), (2.0, 40.0)], seed=1)
    sim = build("ecoserve", small_spec(), 1.0, 0.1, total_instances=10,
                mitosis=dict(n_lower=2, n_upper=4, cooldown_s=2.0), macro_sizes=[2], mitosis_period=1.0)
    routed_after_drain, kinds = [], []
    original = sim.apply

    def watch(actions):
        for a in actions:
            if isinstance(a, Dispatch) and a.instance_id in sim.controller.topology().draining:
                routed_after_drain.append(a.request_id)
            if isinstance(a, Scale):
                kinds.append(a.kind)
        return original(actions)
    sim.apply = watch
    res = sim.run(wl)
    assert len(res.records) == len(wl)
    assert not routed_after_drain
    assert {"add", "split", "drain", "release"} <= set(kinds), kinds
    sizes = [s for t in res.extra["timeline"] for s in t["sizes"]]
    assert max(t["active"] for t in res.extra["timeline"]) > 2  # it expanded
    assert all(1 <= s <= 4 for s in sizes)


def test_link_queue_shares_bandwidth():
    q = LinkQueue(link("10gbe"))
    rate = q.rate
    q.start("a", rate * 1.0, 0.0)
    q.start("b", rate * 1.0, 0.0)
    lat = q.link.latency
    assert q.next_completion() == pytest.approx(2.0 + lat)  # two equal transfers share the link
    assert q.advance_to(2.0 + lat + 1e-6) == ["a", "b"]


# ---- the output hold as the client sees it ----------------------------------------------------------
def _one_request_sim(hold_at=None, release_at=None):
    """One vLLM instance serving one request; the test holds and releases its output at fixed times."""
    sim = build("vllm", ClusterSpec(model="llama-3-8b", gpu="L20", tp=1, num_instances=1), 5.0, 0.1)
    handle = sim.controller.handle

    def with_hold(event):
        if isinstance(event, TimerFired) and event.name == "test-hold":
            return [HoldOutput(0)]
        if isinstance(event, TimerFired) and event.name == "test-release":
            return [ReleaseOutput(0)]
        return handle(event)
    sim.controller.handle = with_hold
    sim.loop.push([Timer(t, name) for t, name in ((hold_at, "test-hold"), (release_at, "test-release"))
                   if t is not None])
    res = sim.run([SimRequest("a", 0.01, 200, 40)])
    (rec,) = res.records
    return sim, rec


def test_without_a_hold_delivery_is_production_and_ttft_is_the_decode_start():
    _, r = _one_request_sim()
    assert (r.first_delivery, r.last_delivery) == (r.first_token, r.finish)
    assert r.ttft == r.decode_start - r.arrival
    assert r.tpot == r.tpot_delivered == pytest.approx((r.finish - r.decode_start) / 39)


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_records_without_holds_keep_their_definitions(name):
    res = build(name, small_spec(), 5.0, 0.1).run(synthetic("sharegpt", 6.0, 60, seed=2))
    for r in res.records:
        assert r.first_delivery == r.first_token and r.last_delivery == r.finish
        assert r.ttft == r.decode_start - r.arrival


def test_a_request_finishing_while_held_is_flushed_at_its_finish_with_its_generation_pace():
    _, free = _one_request_sim()
    sim, held = _one_request_sim(hold_at=0.0, release_at=free.finish + 10.0)
    assert held.finish == free.finish  # the hold delays delivery, not the work
    assert held.first_delivery == held.last_delivery == held.finish  # recorded at once, not at the release
    assert held.ttft == pytest.approx(held.finish - held.arrival)
    assert held.tpot == pytest.approx(free.tpot) and held.tpot > 0  # no TPOT 0 from the burst
    assert held.tpot_delivered == 0.0  # the client view: every token arrived in one burst


def test_a_request_partly_held_gets_its_first_token_at_the_release():
    _, free = _one_request_sim()
    release = (free.decode_start + free.finish) / 2
    _, held = _one_request_sim(hold_at=0.0, release_at=release)
    assert held.first_delivery == release and held.last_delivery == held.finish
    assert held.ttft == pytest.approx(release - held.arrival)
    assert held.ttft_first_token == pytest.approx(release - held.arrival)
    assert (held.decode_start, held.tpot) == (free.decode_start, pytest.approx(free.tpot))
    assert held.tpot_delivered == pytest.approx((held.finish - release) / 39)


def test_a_hold_after_the_first_token_leaves_ttft_alone():
    _, free = _one_request_sim()
    _, held = _one_request_sim(hold_at=free.decode_start + 1e-4, release_at=free.finish - 1e-3)
    assert (held.ttft, held.tpot) == (pytest.approx(free.ttft), pytest.approx(free.tpot))
