"""Controllers in virtual time with fake instances (no performance model): where requests go."""
import pytest

from ecoserve.clock import VirtualClock
from ecoserve.cluster import ControllerOptions, InstanceStatus, RequestState, build_controller, setups_for
from ecoserve.cluster.events import (STAGING, CloseWindow, Dispatch, FinishRequest, InstanceJoined, InstanceLost,
                                     InstanceReported, PrefillDone, RequestArrived,
                                     RequestFinished, Scale, SetTimer, TimerFired, TransferDone, TransferKV)


class FakeFleet:
    """Instances that only remember what was dispatched to them; statuses built by hand."""

    def __init__(self, clock, free=100_000):
        self.clock = clock
        self.reqs: dict[int, dict[str, RequestState]] = {}
        self.free: dict[int, int] = {}
        self.default_free = free

    def status(self, iid):
        reqs = tuple(self.reqs.get(iid, {}).values())
        return InstanceStatus(iid, self.clock.now(), "decode", 0.0, reqs, self.free.get(iid, self.default_free),
                              100_000, num_running=len(reqs))

    def apply(self, acts, prompt_len=10):
        for a in acts:
            if isinstance(a, Dispatch):
                self.reqs.setdefault(a.instance_id, {})[a.request_id] = RequestState(
                    a.request_id, self.clock.now(), prompt_len, None, 0)
        return acts


def controller(strategy, clock, fleet, **kw):
    return build_controller(strategy, ControllerOptions(1.0, 0.1, num_instances=4, kv_bytes_per_token=1000.0, **kw),
                            clock, lambda n: n / 1000, statuses=fleet.status)


def arrive(c, rid, prompt=10, max_tokens=5, now=0.0):
    return c.handle(RequestArrived(rid, prompt, max_tokens, now))


def test_nodg_round_robin_order_and_least_loaded():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = controller("vllm", clock, fleet)
    assert c.setups[0].policy == "prefill_first" and not c.has_windows
    order = [arrive(c, f"r{i}")[0].instance_id for i in range(6)]
    assert order == [0, 1, 2, 3, 0, 1]
    c2 = controller("sarathi", clock, fleet, balance="least_loaded")
    assert c2.setups[0].policy == "chunked" and c2.setups[0].max_num_batched_tokens == 512
    fleet.reqs = {0: {"x": RequestState("x", 0.0, 10, None, 0)}, 1: {}, 2: {"y": RequestState("y", 0.0, 10, None, 0)}}
    fleet.free = {1: 10, 3: 20}
    assert arrive(c2, "a")[0].instance_id == 3  # 1 and 3 are empty; 3 has more free KV


def test_joined_instances_are_routed_on_their_reported_status():
    clock = VirtualClock()
    board = {}
    c = build_controller("vllm", ControllerOptions(1.0, 0.1, num_instances=0, balance="least_loaded"), clock,
                         lambda n: n / 1000, statuses=board.__getitem__)
    for i in range(2):
        board[i] = InstanceStatus(i, 0.0, "idle", 0.0, (), 1000, 1000)
        assert c.handle(InstanceJoined(i, 1000)) == []
    board[0] = InstanceStatus(0, 0.0, "decode", 0.0, (RequestState("x", 0.0, 5, 0.1, 3),), 900, 1000)
    c.handle(InstanceReported(0))
    assert arrive(c, "a")[0].instance_id == 1
    assert c.topology().roles == {} and c.summary() == {"num_dispatched": {0: 0, 1: 1}}


def test_fudg_prefill_transfer_decode_with_byte_counts():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = controller("mooncake", clock, fleet, pd=(1, 3))
    assert [c.setups[i].role for i in range(4)] == ["prefill", "decode", "decode", "decode"]
    assert c.summary()["kv_path"] == "inter_node" and {s.kv_path for s in c.setups.values()} == {"inter_node"}
    acts = fleet.apply(arrive(c, "a", prompt=300, max_tokens=20))
    assert acts == [Dispatch("a", 0, 1)]  # prefill leg: the first token only
    acts = c.handle(PrefillDone("a", 0, 300))
    assert acts == [TransferKV("a", 0, STAGING, 300, 300 * 1000.0)] and c.summary()["kv_transferred_bytes"] == 300_000
    fleet.free = {1: 100, 2: 400, 3: 200}  # the decode side needs prompt + output = 320 tokens
    acts = c.handle(TransferDone("a", 0, STAGING, 300_000))
    assert acts == [Dispatch("a", 2, 19, imported_tokens=300)]  # most free KV; 19 more tokens to come


def test_fudg_holds_transferred_kv_until_a_decode_instance_has_room():
    clock = VirtualClock()
    fleet = FakeFleet(clock, free=50)
    c = controller("distserve", clock, fleet)
    assert c.summary()["kv_path"] == "intra_node"
    for rid in ("a", "b"):
        arrive(c, rid, prompt=100, max_tokens=10)
        c.handle(PrefillDone(rid, 0, 100))
        assert c.handle(TransferDone(rid, 0, STAGING, 100_000)) == []  # no decode instance has 110 tokens
    assert c.handle(InstanceReported(0)) == []  # a prefill instance's step changes nothing
    fleet.free = {3: 1000}
    acts = c.handle(InstanceReported(3))
    assert [(a.request_id, a.instance_id) for a in acts] == [("a", 3), ("b", 3)]  # FIFO


def test_lost_instance_reroutes_unstarted_requests_and_fails_streaming_ones():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = controller("vllm", clock, fleet)
    fleet.apply(arrive(c, "a"))  # -> 0
    fleet.apply(arrive(c, "b"))  # -> 1
    fleet.apply(arrive(c, "c"))  # -> 2
    fleet.apply(arrive(c, "d"))  # -> 3
    fleet.apply(arrive(c, "e"))  # -> 0
    fleet.reqs[0]["a"] = RequestState("a", 0.0, 10, 0.5, 2)  # streaming already
    acts = c.handle(InstanceLost(0))
    assert FinishRequest("a", "instance 0 was lost") in acts
    moved = [a for a in acts if isinstance(a, Dispatch)]
    assert [m.request_id for m in moved] == ["e"] and moved[0].instance_id != 0
    assert all(arrive(c, f"n{i}")[0].instance_id != 0 for i in range(6))


def test_a_request_is_rerouted_at_most_twice():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = controller("vllm", clock, fleet)
    acts = fleet.apply(arrive(c, "a"))
    for moves in range(3):  # its instance is lost before its first token, again and again
        where = acts[0].instance_id
        fleet.reqs.pop(where, None)
        acts = fleet.apply(c.handle(InstanceLost(where)))
        if moves < 2:
            assert isinstance(acts[0], Dispatch) and acts[0].instance_id != where
    assert acts == [FinishRequest("a", f"instance {where} was lost (2 re-routes)")]


def test_padg_mitosis_add_split_drain_merge_never_loses_or_duplicates():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = build_controller("ecoserve", ControllerOptions(1.0, 0.1, num_instances=2, total_instances=6,
                                                       macro_sizes=(2,), mitosis_period=1.0, ttft_window=3.0,
                                                       mitosis=dict(n_lower=2, n_upper=3, cooldown_s=0.0)),
                         clock, lambda n: n / 1000, statuses=fleet.status)
    start = c.start()
    assert [a for a in start if isinstance(a, CloseWindow)] == [CloseWindow(i) for i in range(6)]
    timer = next(a for a in start if isinstance(a, SetTimer))
    dispatched, kinds, rid = {}, [], 0

    def send(acts):
        for a in fleet.apply(acts):
            if isinstance(a, Dispatch):
                assert a.request_id not in dispatched, "dispatched twice"
                assert a.instance_id not in c.topology().draining, "routed to a draining instance"
                dispatched[a.request_id] = a.instance_id
            if isinstance(a, Scale):
                kinds.append(a.kind)
            if isinstance(a, SetTimer) and a.name == "mitosis":
                nonlocal timer
                timer = a

    def finish_all(ttft):
        for iid, reqs in fleet.reqs.items():
            for r in list(reqs):
                if not r.startswith("seed"):
                    del reqs[r]
                    send(c.handle(RequestFinished(r, iid, ttft)))

    for t in range(1, 25):
        hot = t <= 4
        for _ in range(3):
            rid += 1
            send(arrive(c, f"r{rid}", now=clock.now()))
        finish_all(ttft=5.0 if hot else 0.01)
        if not hot:  # cold: every instance decodes one request with plenty of slack, so mitosis contracts
            topo = c.topology()
            for iid in range(6):
                if iid in topo.draining:
                    fleet.reqs[iid] = {}
                elif iid not in topo.free:
                    fleet.reqs.setdefault(iid, {})[f"seed{iid}"] = RequestState(f"seed{iid}", 0.0, 10, 0.0, 10_000)
        clock.advance_to(timer.time)
        send(c.handle(TimerFired(timer.name)))
        for iid in range(6):
            send(c.handle(InstanceReported(iid)))
    assert {"add", "split", "drain", "merge", "release"} <= set(kinds), kinds
    assert sorted(dispatched) == sorted(f"r{i}" for i in range(1, rid + 1))  # every request exactly once
    topo = c.topology()
    sizes = [len(m.instances) for m in c.macros.values()]
    assert all(1 <= s <= 3 for s in sizes)
    assert {m: sorted(r.instances) for m, r in c.macros.items()} == {
        m: sorted(v) for m, v in topo.macros.items()}  # routers mirror the topology
    assert c.summary()["timeline"] and set(c.summary()["num_dispatched"]) == set(range(6))


def test_unknown_strategy_and_bad_split_are_clear_errors():
    clock = VirtualClock()
    with pytest.raises(ValueError, match="unknown strategy"):
        build_controller("orca", ControllerOptions(1.0, 0.1), clock, lambda n: 0.0, statuses=lambda i: None)
    with pytest.raises(ValueError, match="does not add up"):
        build_controller("mooncake", ControllerOptions(1.0, 0.1, num_instances=4, pd=(1, 2)), clock, lambda n: 0.0,
                         statuses=lambda i: None)
    with pytest.raises(ValueError, match="does not add up"):
        setups_for("mooncake", ControllerOptions(1.0, 0.1, num_instances=4, pd=(1, 2)))


@pytest.mark.parametrize("strategy", ["vllm", "sarathi", "distserve", "mooncake", "ecoserve"])
def test_setups_for_matches_the_controller_it_would_build(strategy):
    opts = ControllerOptions(1.0, 0.1, num_instances=4, total_instances=6 if strategy == "ecoserve" else None)
    c = build_controller(strategy, opts, VirtualClock(), lambda n: n / 1000, statuses=FakeFleet(VirtualClock()).status)
    assert setups_for(strategy, opts) == c.setups
    assert c.topology().roles == {i: s.role for i, s in c.setups.items()}
    assert set(c.summary()["num_dispatched"]) == set(c.setups)


def test_scale_by_hand_needs_mitosis():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    for strategy in ("vllm", "ecoserve"):
        with pytest.raises(ValueError, match="no mitosis"):
            controller(strategy, clock, fleet).scale_by_hand(0, 1)
    c = build_controller("ecoserve", ControllerOptions(1.0, 0.1, num_instances=2, total_instances=3,
                                                       mitosis=dict(n_lower=1, n_upper=2)),
                         clock, lambda n: n / 1000, statuses=fleet.status)
    assert c.topology().free == (2,) and c.topology().macros == {0: (0, 1)}
    with pytest.raises(ValueError, match="no macro instance 7"):
        c.scale_by_hand(7, 1)
    with pytest.raises(ValueError, match="delta"):
        c.scale_by_hand(0, 2)
    split = [a for a in c.scale_by_hand(0, 1) if isinstance(a, Scale)]
    assert split == [Scale("split", 0, (2,), other=1)]
    assert c.topology().macros == {0: (0, 1), 1: (2,)} and c.topology().free == ()
    with pytest.raises(ValueError, match="no free instance"):
        c.scale_by_hand(0, 1)
    assert [a for a in c.scale_by_hand(0, -1) if isinstance(a, Scale)] == [Scale("drain", 0, (1,))]
    assert c.topology().draining == (1,) and c.topology().macro_of(1) is None
