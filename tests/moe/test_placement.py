"""The placement policy against hand-computed cases with fake cost tables (one time unit per token)."""
import pytest

from ecoserve.moe import (CostTable, ExpertPopularity, MeasuredCost, PlacementPolicy, PrefetchQueue, Priority,
                          RooflineCost, split_host_device)

TOKENS = [8, 1, 0, 2, 4, 1]  # expert 2 gets no tokens


def per_token(n: int) -> float:  # fake host compute: 1 s per token
    return float(n)


def costs(load_s: float = 2.0, base_load_s: float = 0.0) -> CostTable:
    return CostTable(host_s=per_token, device_s=lambda n: 0.1 * n, load_s=load_s, base_load_s=base_load_s)


def policy(budget: int, scores=(9, 1, 5, 3, 7, 2), **kw) -> PlacementPolicy:
    pop = ExpertPopularity(1, 6)
    pop.seed(0, scores)
    return PlacementPolicy(1, 6, budget, costs(**kw), pop)


def test_split_walks_coldest_first_until_host_time_reaches_load_time():
    # walk 1(1) 5(1) 3(2) 4(4) 0(8): comp/load = 1/2, 2/4, 4/6, 8/8 -> stop at expert 4 (ratio 1 is not < 1)
    routed = {e: n for e, n in enumerate(TOKENS) if n}
    assert split_host_device(routed, costs()) == ((1, 5, 3), (0, 4))
    # a base load (attention + gate) gives the host more time: 8/9 < 1, then 16/11 stops at expert 0
    assert split_host_device(routed, costs(base_load_s=1.0)) == ((1, 5, 3, 4), (0,))
    # a link so fast that nothing hides under it: everything is loaded
    assert split_host_device(routed, costs(load_s=0.5)) == ((), (0, 4, 3, 5, 1))
    assert split_host_device({}, costs()) == ((), ())


def test_plan_hits_loads_host_and_evicts_the_least_popular_unused_resident():
    # resident 0, 2, 5 (budget full); misses 1(1) 3(2) 4(4): 1/2, 3/4 host, then 7/6 -> 4 is loaded,
    # taking the slot of expert 2 (resident, not routed this step)
    plan = policy(3).plan_layer(0, TOKENS, resident={0, 2, 5})
    assert (plan.hits, plan.load, plan.host, plan.admit, plan.evict) == ((0, 5), (4,), (1, 3), (4,), (2,))
    assert sorted(plan.device + plan.host) == [0, 1, 3, 4, 5]


def test_plan_loads_through_a_transient_buffer_when_no_slot_can_be_freed():
    plan = policy(2).plan_layer(0, TOKENS, resident={0, 5})  # both residents are routed: nothing to evict
    assert (plan.hits, plan.load, plan.host, plan.admit, plan.evict) == ((0, 5), (4,), (1, 3), (), ())
    plan = policy(0).plan_layer(0, TOKENS, resident=set())  # no device pool: every load is transient
    assert (plan.hits, plan.load, plan.host, plan.admit) == ((), (0, 4), (1, 5, 3), ())
    plan = policy(4).plan_layer(0, TOKENS, resident={0})  # free slots: no eviction
    assert (plan.load, plan.admit, plan.evict) == ((4,), (4,), ())
    plan = policy(6).plan_layer(0, [3, 3, 3, 3, 3, 3], resident={0, 1, 2})  # hottest admitted first
    assert (plan.load, plan.admit) == ((5, 4, 3), (5, 4, 3))


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="token counts"):
        policy(3).plan_layer(0, TOKENS[:5], resident=set())
    with pytest.raises(ValueError, match="exceed the budget"):
        policy(1).plan_layer(0, TOKENS, resident={0, 1})
    with pytest.raises(ValueError, match="resident experts per layer"):
        policy(7)


def test_resident_target_follows_popularity():
    assert policy(3).resident_target(0) == (0, 4, 2)


def test_prefetch_queue_serves_on_demand_then_next_layer_then_popularity():
    q = PrefetchQueue()
    q.push(1, 3, Priority.POPULARITY)
    q.push(1, 2, Priority.NEXT_LAYER)
    q.push(2, 1, Priority.POPULARITY)
    q.push(0, 5, Priority.ON_DEMAND)
    q.push(2, 1, Priority.NEXT_LAYER)  # promoted, behind (1, 2) within its level
    q.push(0, 5, Priority.POPULARITY)  # already higher: stays on demand
    assert len(q) == 4 and (1, 3) in q
    assert q.items() == [(0, 5, Priority.ON_DEMAND), (1, 2, Priority.NEXT_LAYER), (2, 1, Priority.NEXT_LAYER),
                         (1, 3, Priority.POPULARITY)]
    assert q.pop() == (0, 5, Priority.ON_DEMAND)
    q.discard(1, 2)
    assert q.pop() == (2, 1, Priority.NEXT_LAYER)
    q.push(3, 0, Priority.POPULARITY)
    q.drop_below(Priority.NEXT_LAYER)
    assert q.pop() is None and len(q) == 0


def test_enqueue_prefetch_orders_predicted_before_popular_and_nearest_layer_first():
    pop = ExpertPopularity(3, 4)
    for layer, scores in enumerate([(4, 3, 2, 1), (1, 2, 3, 4), (4, 1, 1, 3)]):
        pop.seed(layer, scores)
    pol = PlacementPolicy(3, 4, 2, costs(), pop)
    q = PrefetchQueue()
    resident = {0: {0, 1}, 1: {3}, 2: set()}
    pol.enqueue_prefetch(q, next_layer=1, predicted=[0, 3], resident=resident)
    assert q.items() == [(1, 0, Priority.NEXT_LAYER),  # 3 is resident already
                         (1, 2, Priority.POPULARITY), (2, 0, Priority.POPULARITY), (2, 3, Priority.POPULARITY)]


def test_victim_popularity_prefetch_replaces_only_a_colder_expert():
    pol = policy(3)  # ranked 0, 4, 2, 3, 5, 1
    assert pol.victim(0, 4, resident={0, 2, 5}, keep={5}, priority=Priority.POPULARITY) == 2
    assert pol.victim(0, 1, resident={0, 2, 5}, keep=(), priority=Priority.POPULARITY) is None
    assert pol.victim(0, 1, resident={0, 2, 5}, keep=(), priority=Priority.NEXT_LAYER) == 5
    assert pol.victim(0, 1, resident={0}, keep={0}, priority=Priority.ON_DEMAND) is None


def test_popularity_is_a_moving_average_of_routed_tokens():
    pop = ExpertPopularity(2, 3, decay=0.5)
    pop.observe(1, [4, 0, 0])
    pop.observe(1, [0, 2, 0])
    assert pop.scores(1) == [2.0, 1.0, 0.0] and pop.scores(0) == [0.0, 0.0, 0.0]
    assert pop.ranked(1) == [0, 1, 2] and pop.ranked(0) == [0, 1, 2]  # ties by id
    with pytest.raises(ValueError, match="3 experts"):
        pop.observe(0, [1, 2])
    with pytest.raises(ValueError, match="decay"):
        ExpertPopularity(1, 2, decay=1.0)


def test_cost_curves():
    m = MeasuredCost.of([(4, 2.0), (1, 1.0), (8, 3.0)])
    assert (m(0), m(1), m(2), m(4), m(6), m(16)) == (0.0, 1.0, pytest.approx(4 / 3), 2.0, 2.5, 5.0)
    assert MeasuredCost.of([(2, 4.0)])(3) == 6.0  # one point: proportional
    with pytest.raises(ValueError, match="increasing"):
        MeasuredCost((2, 2), (1.0, 1.0))
    r = RooflineCost(flops_per_token=10.0, weight_bytes=100.0, flops=10.0, bandwidth=10.0, launch_s=1.0)
    assert (r(0), r(1), r(20)) == (0.0, 11.0, 21.0)  # memory-bound, then compute-bound
    t = CostTable.from_link(per_token, per_token, expert_bytes=100.0, link_bandwidth=50.0, link_latency_s=0.5)
    assert (t.load_s, t.base_load_s) == (2.5, 0.0)
    with pytest.raises(ValueError, match="load time"):
        CostTable(per_token, per_token, load_s=0.0)
