"""The overall scheduler: macro instances ranked by outstanding work, and both get requests under load."""
import pytest

from ecoserve.clock import VirtualClock
from ecoserve.cluster import ControllerOptions, InstanceStatus, RequestState, build_controller
from ecoserve.cluster.controller import NoInstanceError
from ecoserve.cluster.events import Dispatch, RequestArrived
from ecoserve.cluster.overall import OverallScheduler, instance_load
from ecoserve.cluster.profile import PrefillProfile
from ecoserve.cluster.router import MacroInstance, PendingRequest, RouterConfig

from tests.cluster.test_controllers import FakeFleet


def unprefilled(rid, prompt):
    return RequestState(rid, 0.0, prompt, None, 0)


def decoding(rid, prompt):
    return RequestState(rid, 0.0, prompt, 0.5, 3)


def status(iid, reqs=(), free=1000, total=1000):
    return InstanceStatus(iid, 1.0, "decode", 0.0, tuple(reqs), free, total)


def macros(*sizes):
    profile = PrefillProfile(lambda n: n / 1000, 2048)
    out, nxt = {}, 0
    for m, n in enumerate(sizes):
        out[m] = MacroInstance(list(range(nxt, nxt + n)), profile, RouterConfig(5.0, 0.1), macro_id=m)
        nxt += n
    return out


def test_instance_load_counts_only_prompts_not_yet_prefilled():
    load = instance_load(status(0, [unprefilled("a", 100), decoding("b", 700), unprefilled("c", 50)], free=250))
    assert load.unprefilled_tokens == 150
    assert load.kv_used == pytest.approx(0.75)


def test_picks_least_outstanding_work_per_instance_over_size():
    board = {0: status(0, [unprefilled("a", 300)]), 1: status(1, [unprefilled("b", 300)]),
             2: status(2, [unprefilled("c", 100)])}
    overall = OverallScheduler(macros(2, 1), board.__getitem__)
    assert overall.pick().macro_id == 1  # 100 tokens on one instance < 600 tokens over two
    board[2] = status(2, [unprefilled("c", 400)])
    assert overall.pick().macro_id == 0  # 400 > 300 per instance


def test_router_pending_prompts_count_as_work():
    board = {i: status(i) for i in range(4)}
    ms = macros(2, 2)
    overall = OverallScheduler(ms, board.__getitem__)
    ms[0].pending.append(PendingRequest("p", 500, 10, 0.0))
    assert overall.pick().macro_id == 1


def test_ties_go_to_lower_kv_use_then_lower_id():
    board = {i: status(i) for i in range(4)}
    overall = OverallScheduler(macros(2, 2), board.__getitem__)
    assert overall.pick().macro_id == 0
    board[0] = status(0, [decoding("d", 500)], free=500)  # decoding: no outstanding prefill, more KV in use
    assert overall.pick().macro_id == 1


def test_load_is_recomputed_for_a_new_status_only():
    board = {0: status(0), 1: status(1)}
    overall = OverallScheduler(macros(1, 1), board.__getitem__)
    first = overall.load_of(0)
    assert overall.load_of(0) is first  # the same status object: cached
    board[0] = status(0, [unprefilled("a", 10)])
    assert overall.load_of(0).unprefilled_tokens == 10


def test_no_instance_left_is_a_clear_error():
    ms = macros(1)
    ms[0].instances.clear()
    with pytest.raises(NoInstanceError):
        OverallScheduler(ms, lambda i: status(i)).pick()


@pytest.mark.parametrize("mode", ["paper", "reference"])
def test_two_macro_instances_under_steady_load_both_receive_requests(mode):
    """A steady stream whose prefills complete between arrivals: the router never queues in reference
    mode, so ranking by router queue alone would send every request to one macro instance."""
    clock = VirtualClock()
    fleet = FakeFleet(clock)
    c = build_controller("ecoserve", ControllerOptions(5.0, 0.1, num_instances=4, macro_sizes=(2, 2),
                                                       router_mode=mode),
                         clock, lambda n: n / 1000, statuses=fleet.status)
    fleet.apply(c.start())
    macro_of = {i: m for m, v in c.topology().macros.items() for i in v}
    per_macro = {0: 0, 1: 0}
    for k in range(60):
        clock.advance_to(k * 0.1)
        for a in fleet.apply(c.handle(RequestArrived(f"r{k}", 200, 10, clock.now()))):
            if isinstance(a, Dispatch):
                per_macro[macro_of[a.instance_id]] += 1
        if k % 3 == 2:  # every third arrival, what was routed has been prefilled and decodes
            for reqs in fleet.reqs.values():
                for rid, r in reqs.items():
                    reqs[rid] = r._replace(first_token_time=clock.now(), num_output_tokens=1)
    assert sum(per_macro.values()) == 60
    assert min(per_macro.values()) >= 20, per_macro  # balanced, not all on one
