"""Controllers losing an instance and getting it back in the same slot (the live frontend restarts it; the
simulator drives the same controllers): routing resumes, FuDG serves whole requests while a role is empty."""
import pytest

from ecoserve.clock import VirtualClock
from ecoserve.cluster import ControllerOptions, build_controller
from ecoserve.cluster.controller import NoInstanceError
from ecoserve.cluster.events import (STAGING, CloseWindow, Dispatch, InstanceJoined, InstanceLost, PrefillDone,
                                     RequestArrived, TransferDone, TransferKV)
from tests.cluster.test_controllers import FakeFleet


def build(strategy, fleet, clock, n=4, **kw):
    return build_controller(strategy, ControllerOptions(1.0, 0.1, num_instances=n, kv_bytes_per_token=1000.0, **kw),
                            clock, lambda n: n / 1000, statuses=fleet.status)


def arrive(c, fleet, rid, prompt=10, max_tokens=5):
    return fleet.apply(c.handle(RequestArrived(rid, prompt, max_tokens, 0.0)))


def targets(acts):
    return [a.instance_id for a in acts if isinstance(a, Dispatch)]


@pytest.mark.parametrize("strategy", ["vllm", "sarathi"])
def test_nodg_lost_instance_is_routed_again_after_it_rejoins(strategy):
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = build(strategy, fleet, clock)
    c.handle(InstanceLost(2))
    assert 2 not in [t for i in range(8) for t in targets(arrive(c, fleet, f"a{i}"))]
    assert c.handle(InstanceJoined(2, 100_000)) == []
    assert 2 in [t for i in range(8) for t in targets(arrive(c, fleet, f"b{i}"))]
    c.handle(InstanceJoined(2, 100_000))  # a second join of the same slot adds nothing twice
    assert c.router.instances.count(2) == 1


def test_nodg_with_no_instance_says_so():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = build("vllm", fleet, clock, n=1)
    c.handle(InstanceLost(0))
    with pytest.raises(NoInstanceError, match="no instance is ready"):
        arrive(c, fleet, "a")
    c.handle(InstanceJoined(0, 100_000))
    assert targets(arrive(c, fleet, "b")) == [0]


def test_fudg_without_its_prefill_instance_serves_whole_requests_on_the_decode_one():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = build("distserve", fleet, clock, n=2)  # 1:1
    assert arrive(c, fleet, "a") == [Dispatch("a", 0, 1)]  # disaggregated: one token on the prefill side
    c.handle(InstanceLost(0))
    assert not c.disaggregated
    assert arrive(c, fleet, "b", max_tokens=7) == [Dispatch("b", 1, 7)]  # the whole request, no KV transfer
    assert c.handle(InstanceJoined(0, 100_000)) == []
    assert c.disaggregated
    assert arrive(c, fleet, "c") == [Dispatch("c", 0, 1)]  # back to prefill -> KV -> decode
    acts = c.handle(PrefillDone("c", 0, 10))
    assert acts == [TransferKV("c", 0, STAGING, 10, 10 * 1000.0)]
    assert targets(c.handle(TransferDone("c", 0, STAGING, 10_000))) == [1]


def test_fudg_without_its_decode_instance_decodes_staged_kv_where_it_is():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = build("distserve", fleet, clock, n=2)
    arrive(c, fleet, "a", max_tokens=5)
    c.handle(PrefillDone("a", 0, 10))
    c.handle(InstanceLost(1))
    # the KV staged on the prefill instance is decoded there: a decode dispatch to its own holder
    assert c.handle(TransferDone("a", 0, STAGING, 10_000)) == [Dispatch("a", 0, 4, imported_tokens=10)]
    assert arrive(c, fleet, "b", max_tokens=6) == [Dispatch("b", 0, 6)]
    c.handle(InstanceJoined(1, 100_000))
    assert arrive(c, fleet, "d") == [Dispatch("d", 0, 1)]


def test_fudg_with_no_instance_left_names_what_is_missing():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = build("mooncake", fleet, clock, n=3, pd=(1, 2))
    for iid in (0, 1, 2):
        c.handle(InstanceLost(iid))
    with pytest.raises(NoInstanceError, match="no instance is ready: .*1 prefill and 2 decode"):
        arrive(c, fleet, "a")
    c.handle(InstanceJoined(2, 100_000))
    assert arrive(c, fleet, "b", max_tokens=3) == [Dispatch("b", 2, 3)]  # a decode instance serves it whole


def test_padg_lost_instance_goes_back_to_its_macro_instance_with_its_window_closed():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = build("ecoserve", fleet, clock, n=4, macro_sizes=(2, 2))
    c.handle(InstanceLost(1))
    assert 1 not in c.macros[0].instances and c.layout.macros[0] == [0]
    acts = c.handle(InstanceJoined(1, 100_000))
    assert CloseWindow(1) in acts
    assert sorted(c.macros[0].instances) == [0, 1] and sorted(c.layout.macros[0]) == [0, 1]
    assert c.topology().macro_of(1) == 0


def test_padg_lost_free_instance_leaves_the_pool_and_comes_back_to_it():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = build("ecoserve", fleet, clock, n=2, total_instances=3, mitosis={"n_lower": 1, "n_upper": 2})
    assert c.layout.free == [2]
    c.handle(InstanceLost(2))
    assert c.layout.free == []
    with pytest.raises(ValueError, match="no free instance"):
        c.scale_by_hand(0, 1)
    c.handle(InstanceJoined(2, 100_000))
    assert c.layout.free == [2]


def test_padg_with_every_instance_lost_names_what_is_missing():
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = build("ecoserve", fleet, clock, n=2)
    c.handle(InstanceLost(0))
    c.handle(InstanceLost(1))
    with pytest.raises(NoInstanceError, match="no instance is ready"):
        arrive(c, fleet, "a")
    c.handle(InstanceJoined(0, 100_000))
    assert targets(arrive(c, fleet, "b")) == [0]
