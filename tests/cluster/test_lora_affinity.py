"""Adapter-affinity routing: a LoRA request goes to an instance that holds its adapter while that one has room,
within each strategy's own rules; base-model requests route as before."""
from ecoserve.clock import VirtualClock
from ecoserve.cluster import InstanceStatus, MacroInstance, PrefillProfile, RouterConfig
from ecoserve.cluster.baselines import FuDGRouter, NoDGController, NoDGRouter
from ecoserve.cluster.events import Dispatch, RequestArrived
from ecoserve.cluster.status import holds_adapter, prefer_holders

PROFILE = PrefillProfile(lambda n: n / 1000, 4096)


def status(iid, loras=(), free=10_000, running=0, seats=256, slots=4):
    return InstanceStatus(iid, 0.0, "decode", 0.0, (), free, 10_000, num_running=running, max_num_seqs=seats,
                          loras=tuple(loras), free_lora_slots=slots)


def test_holds_adapter_needs_the_adapter_a_seat_and_the_prompts_kv():
    assert holds_adapter(status(0, ["a"]), "a", 100)
    assert not holds_adapter(status(0, ["b"]), "a", 100)
    assert not holds_adapter(status(0, ["a"], running=256), "a", 100)  # no seat
    assert not holds_adapter(status(0, ["a"], free=99), "a", 100)  # no room for the prompt's KV


def test_prefer_holders_keeps_order_and_falls_back_to_all():
    board = {0: status(0), 1: status(1, ["a"]), 2: status(2, ["a", "b"])}
    assert prefer_holders([0, 1, 2], "a", 10, board.__getitem__) == [1, 2]
    assert prefer_holders([0, 1, 2], "c", 10, board.__getitem__) == [0, 1, 2]
    assert prefer_holders([0, 1, 2], None, 10, board.__getitem__) == [0, 1, 2]
    board[0] = status(0, slots=0)  # its batch runs --max-loras adapters already: a new one would wait there
    assert prefer_holders([0, 1, 2], "c", 10, board.__getitem__) == [1, 2]
    full = {i: status(i, slots=0) for i in range(3)}
    assert prefer_holders([0, 1, 2], "c", 10, full.__getitem__) == [0, 1, 2]


def test_nodg_round_robin_sends_an_adapter_to_its_holder_while_it_has_room():
    board = {0: status(0), 1: status(1, ["x"]), 2: status(2)}
    r = NoDGRouter([0, 1, 2])
    assert [r.route(board.__getitem__, "x", 50) for _ in range(4)] == [1, 1, 1, 1]
    assert [r.route(board.__getitem__) for _ in range(3)] == [0, 1, 2]  # base requests: round robin, untouched
    board[1] = status(1, ["x"], running=256)  # the holder is full: the policy decides
    assert r.route(board.__getitem__, "x", 50) == 0


def test_a_holder_beyond_its_share_of_the_requests_is_passed_over():
    from ecoserve.cluster import RequestState
    busy = tuple(RequestState(f"q{k}", 0.0, 10, None, 0) for k in range(6))
    board = {0: InstanceStatus(0, 0.0, "decode", 0.0, busy, 10_000, 10_000, num_running=6, loras=("x",)),
             1: status(1), 2: status(2)}
    assert prefer_holders([0, 1, 2], "x", 10, board.__getitem__) == [0, 1, 2]  # 6 > 6/3 + 1: x spreads
    for i in (1, 2):  # the others as busy: x stays with its holder
        board[i] = InstanceStatus(i, 0.0, "decode", 0.0, busy[:5], 10_000, 10_000, num_running=5)
    assert prefer_holders([0, 1, 2], "x", 10, board.__getitem__) == [0]  # 6 <= 16/3 + 1


def test_nodg_least_loaded_picks_the_least_loaded_holder():
    board = {0: status(0, ["x"], running=5), 1: status(1, ["x"], running=1), 2: status(2)}
    r = NoDGRouter([0, 1, 2], policy="least_loaded")
    assert r.route(board.__getitem__, "x", 50) in (0, 1)
    assert r.route(board.__getitem__, "y", 50) in (0, 1, 2)


def test_nodg_controller_reads_the_requests_adapter():
    board = {0: status(0), 1: status(1, ["x"])}
    ctl = NoDGController(VirtualClock(), board.__getitem__, [0, 1])
    acts = [ctl.handle(RequestArrived(f"r{i}", 10, 5, 0.0, "x")) for i in range(3)]
    assert [a[0].instance_id for a in acts] == [1, 1, 1]


def test_fudg_prefill_prefers_the_holder():
    board = {0: status(0), 1: status(1, ["x"]), 2: status(2)}
    r = FuDGRouter([0, 1], [2])
    assert r.route_prefill(board.__getitem__, "x", 10) == 1
    assert r.route_prefill(board.__getitem__) == 0


def test_padg_routes_to_a_passing_holder_and_never_past_the_checks():
    mac = MacroInstance([0, 1, 2], PROFILE, RouterConfig(ttft_slo=1.0, tpot_slo=0.1, kv_reserve_frac=0.05))
    board = {0: status(0), 1: status(1), 2: status(2, ["x"])}
    acts = mac.submit("r0", 100, 10, board.__getitem__, 0.0, lora_name="x")
    assert [a.instance_id for a in acts if isinstance(a, Dispatch)] == [2]
    acts = mac.submit("r1", 100, 10, board.__getitem__, 0.0)  # base: the cursor's instance, as before
    assert [a.instance_id for a in acts if isinstance(a, Dispatch)] == [2]
    board[2] = status(2, ["x"], running=256)  # the holder fails the seat check: the cycle's next one takes it
    acts = mac.submit("r2", 100, 10, board.__getitem__, 0.0, lora_name="x")
    assert [a.instance_id for a in acts if isinstance(a, Dispatch)] == [0]
    board[0] = status(0, slots=0)  # no holder passes; of the passing ones, the one with a free adapter slot
    acts = mac.submit("r3", 100, 10, board.__getitem__, 0.0, lora_name="y")
    assert [a.instance_id for a in acts if isinstance(a, Dispatch)] == [1]
