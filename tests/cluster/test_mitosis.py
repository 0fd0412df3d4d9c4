"""Mitosis invariants (bounds, split/merge lose nothing, drained instances get nothing new) and the TTFT
evidence the PaDG controller feeds it."""
from hypothesis import given, settings, strategies as st
import pytest

from ecoserve.clock import VirtualClock
from ecoserve.cluster import (ControllerOptions, MacroTopology, MitosisConfig, MitosisController, RequestState,
                              build_controller)
from ecoserve.cluster.events import Dispatch, RequestArrived, RequestFinished, Scale, TimerFired

from tests.cluster.test_controllers import FakeFleet

HOT, COLD = 10.0, 0.0  # mean TTFT over / under the 5 s SLO


def ctl(sizes=(6,), free=10, n_lower=6, n_upper=11):
    macros, nxt = {}, 0
    for m, n in enumerate(sizes):
        macros[m] = list(range(nxt, nxt + n))
        nxt += n
    return MitosisController(MitosisConfig(n_lower, n_upper, ttft_slo=5.0, cooldown_s=0.0),
                             MacroTopology(macros, free=list(range(nxt, nxt + free))))


def all_ids(c):
    ids = [i for v in c.macros.values() for i in v] + c.topology.free + sorted(c.topology.draining)
    return ids


def test_expand_fills_to_upper_then_splits_into_two_valid_macros():
    c = ctl(sizes=(6,), free=10)
    for k in range(5):
        assert c.step(k, {0: HOT}, {})[0].kind == "add"
    assert len(c.macros[0]) == 11
    a = c.step(6, {0: HOT}, {})[0]
    assert a.kind == "split" and sorted(len(v) for v in c.macros.values()) == [6, 6]  # 12th instance: 2 x 6
    assert sorted(all_ids(c)) == list(range(16))


def test_contract_drains_from_smallest_above_lower_then_merges():
    c = ctl(sizes=(11, 7), free=0)
    acts = c.step(0, {0: COLD, 1: COLD}, {0: 100.0, 1: None})
    assert acts[0].kind == "drain" and acts[0].macro == 1  # the smaller macro instance loses one
    assert len(c.macros[1]) == 6 and len(c.topology.draining) == 1
    c2 = ctl(sizes=(6, 5), free=0, n_lower=3, n_upper=11)
    acts = c2.step(0, {0: COLD}, {0: 100.0})
    kinds = [a.kind for a in acts]
    assert kinds[0] == "drain" and "merge" in kinds and len(c2.macros) == 1  # 6 + 4 <= 11: merged


def test_saved_tpot_inside_range_does_nothing():
    c = ctl(sizes=(8,), free=2)
    assert c.step(0, {0: 1.0}, {0: 5.0 * 9 / 8}) == []  # exactly at S_TTFT*(n+1)/n: no contraction
    assert c.step(0, {0: 1.0}, {0: 5.0 * 9 / 8 + 1e-6})[0].kind == "drain"


def test_no_contraction_while_ttft_is_near_its_slo():
    """Between contract_below_ttft x S_TTFT and S_TTFT a macro instance keeps its size, however much
    TPOT slack it banked; with the margin disabled (1.0) it contracts as soon as TTFT is met."""
    c = ctl(sizes=(8,), free=2)
    assert c.step(0, {0: 2.5}, {0: 99.0}) == []  # 0.5 x 5 s: at the margin
    assert c.step(0, {0: 4.9}, {0: 99.0}) == []
    assert c.step(0, {0: 2.4}, {0: 99.0})[0].kind == "drain"
    loose = MitosisController(MitosisConfig(6, 11, ttft_slo=5.0, contract_below_ttft=1.0, cooldown_s=0.0),
                              MacroTopology({0: list(range(8))}))
    assert loose.step(0, {0: 4.9}, {0: 99.0})[0].kind == "drain"


def test_released_instances_return_to_pool():
    c = ctl(sizes=(8,), free=0)
    iid = c.step(0, {0: COLD}, {0: 99.0})[0].instances[0]
    assert iid in c.topology.draining and iid not in c.macros[0]
    c.release(iid)
    assert iid in c.topology.free and iid not in c.topology.draining


def test_split_needs_room_for_two_macros():
    with pytest.raises(ValueError, match="n_upper"):
        MitosisConfig(6, 10, ttft_slo=5.0)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["hot", "cold", "ok", "release"]), st.integers(0, 5)), max_size=60))
def test_invariants_under_random_signals(signals):
    c = ctl(sizes=(4,), free=14, n_lower=3, n_upper=6)
    total = 18
    for t, (sig, pick) in enumerate(signals):
        ms = sorted(c.macros)
        m = ms[pick % len(ms)]
        if sig == "release" and c.topology.draining:
            c.release(sorted(c.topology.draining)[0])
            continue
        ttft = {m: HOT if sig == "hot" else COLD}
        saved = {m: 1e9 if sig == "cold" else 0.0}
        c.step(t, ttft, saved)
        ids = all_ids(c)
        assert sorted(ids) == list(range(total))  # nothing lost or duplicated
        assert all(1 <= len(v) <= 6 for v in c.macros.values())
        if len(c.macros) > 1:  # a split leaves both at N_l or more; a contraction below N_l merges
            assert all(len(v) >= 3 for v in c.macros.values()), c.macros
        assert not c.topology.draining & {i for v in c.macros.values() for i in v}


def test_no_ttft_evidence_neither_expands_nor_contracts():
    """A macro instance missing from the TTFT means (idle: nothing finished, nothing waiting) keeps its size
    whatever slack it banked; one with evidence next to it still acts."""
    c = ctl(sizes=(6, 6), free=4)
    assert c.step(0, {}, {0: 99.0, 1: 99.0}) == []
    acts = c.step(1, {1: HOT}, {0: 99.0, 1: 0.0})
    assert [(a.kind, a.macro) for a in acts] == [("add", 1)]


# ---- the PaDG controller's TTFT signal ----------------------------------------------------------

def padg(fleet, clock, sizes=(2, 2), total=6, **mitosis):
    opts = ControllerOptions(1.0, 0.1, num_instances=sum(sizes), total_instances=total, macro_sizes=sizes,
                             mitosis_period=1.0, ttft_window=10.0,
                             mitosis=dict(n_lower=2, n_upper=3, cooldown_s=0.0, **mitosis))
    return build_controller("ecoserve", opts, clock, lambda n: n / 1000, statuses=fleet.status)


def route(c, fleet, rid, clock):
    acts = fleet.apply(c.handle(RequestArrived(rid, 10, 5, clock.now())))
    return next(a.instance_id for a in acts if isinstance(a, Dispatch))


def eight_routed():
    """A started two-macro controller with 8 requests routed: (clock, fleet, controller, macro of each instance,
    instance of each request)."""
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = padg(fleet, clock)
    fleet.apply(c.start())
    macro_of = {i: m for m, v in c.topology().macros.items() for i in v}
    where = {f"r{k}": route(c, fleet, f"r{k}", clock) for k in range(8)}
    return clock, fleet, c, macro_of, where


def test_ttft_samples_count_for_the_macro_that_routed_them():
    """Hot TTFTs of macro 1's requests expand macro 1; macro 0, whose requests decode with ample slack but
    have not finished, has no evidence and does not contract (a 0 TTFT there would have drained it)."""
    clock, fleet, c, macro_of, where = eight_routed()
    assert {macro_of[i] for i in where.values()} == {0, 1}
    for rid, iid in where.items():
        if macro_of[iid] == 1:
            del fleet.reqs[iid][rid]
            c.handle(RequestFinished(rid, iid, 10.0))  # over the 1 s SLO
        else:  # still decoding, with plenty of slack
            fleet.reqs[iid][rid] = fleet.reqs[iid][rid]._replace(first_token_time=0.0, num_output_tokens=10_000)
    clock.advance_to(1.0)
    scales = [a for a in c.handle(TimerFired("mitosis")) if isinstance(a, Scale)]
    assert [(a.kind, a.macro) for a in scales] == [("add", 1)]


def test_merge_hands_the_gone_macros_samples_to_the_keeper():
    clock, fleet, c, macro_of, where = eight_routed()
    for rid, iid in where.items():
        if macro_of[iid] == 0:  # macro 0: fast TTFTs and slack to spare, so it contracts
            del fleet.reqs[iid][rid]
            c.handle(RequestFinished(rid, iid, 0.01))
    for iid in c.topology().macros[0]:
        fleet.reqs.setdefault(iid, {})[f"seed{iid}"] = RequestState(f"seed{iid}", 0.0, 10, 0.0, 10_000)
    clock.advance_to(1.0)
    kinds = [(a.kind, a.macro, a.other) for a in c.handle(TimerFired("mitosis")) if isinstance(a, Scale)]
    assert ("merge", 1, 0) in kinds and list(c.topology().macros) == [1]
    assert {m for _, m, _ in c._recent} == {1}  # macro 0's evidence now speaks for the keeper
    assert set(c._macro_of_request.values()) <= {1}


def test_a_cold_macro_never_shrinks_a_hot_one():
    """Macro 1 is cold with slack to spare; macro 0 is larger but over its SLO: the drained instance comes
    from macro 1, not from the largest macro instance."""
    c = ctl(sizes=(7, 6), free=0, n_lower=6, n_upper=13)
    acts = c.step(0, {0: 4.0, 1: COLD}, {0: 0.0, 1: 99.0})
    assert [(a.kind, a.macro) for a in acts][:1] == [("drain", 1)]
    assert c.topology.draining == {12}  # macro 1's newest (it held 7..12); macro 0 keeps all of 0..6


def test_a_cold_macro_at_lower_bound_gives_an_instance_only_if_it_merges():
    c = ctl(sizes=(7, 6), free=0, n_lower=6, n_upper=11)
    assert c.step(0, {0: 4.0, 1: COLD}, {0: 0.0, 1: 99.0}) == []  # 5 + 7 > 11: it would stay at 5
    c = ctl(sizes=(6, 6), free=0, n_lower=6, n_upper=11)
    kinds = [a.kind for a in c.step(0, {0: 4.0, 1: COLD}, {0: 0.0, 1: 99.0})]
    assert kinds == ["drain", "merge"] and sorted(len(v) for v in c.macros.values()) == [11]
