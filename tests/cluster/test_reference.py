"""Reference mode (the authors' released router) on hand-computed cases; times in whole milliseconds."""
import pytest

from ecoserve.cluster import InstanceStatus, MacroInstance, PrefillProfile, RequestState, RouterConfig
from ecoserve.cluster.events import CloseWindow, Dispatch, HoldOutput, OpenWindow, ReleaseOutput, SetTimer
from ecoserve.cluster.profile import reference_blocks

PROFILE = PrefillProfile(lambda n: n / 1000, 4096)  # anchors 16 ms and 4096 ms: a prompt of n tokens is n ms


def st(iid, reqs=(), free=100_000, now=10.5):
    return InstanceStatus(iid, now, "decode", 10.0, tuple(reqs), free, 100_000)


def decoding(rid, first_token, tokens):
    return RequestState(rid, 0.0, 100, first_token, tokens)


def ref(n=3, hold=None):
    mac = MacroInstance(list(range(n)), PROFILE, RouterConfig(1.0, 0.1, mode="reference", output_hold=hold))
    return mac


def route(mac, rid, prompt, statuses, now=10.5):
    return mac.submit(rid, prompt, 8, lambda i: statuses.get(i, st(i)), now)


def dispatched(acts):
    return [a.instance_id for a in acts if isinstance(a, Dispatch)]


def test_profile_whole_ms_and_block_count():
    p = PrefillProfile(lambda n: 0.0107 + n / 1000, 4096)  # T(16) = 26.7 ms -> 26; T(4096) = 4106.7 -> 4106
    assert (p.reference_ms(16), p.reference_ms(4096)) == (26, 4106)
    assert p.reference_ms(8) == 13  # 26 * 8 / 16
    assert p.reference_ms(100) == 100  # int(4106 * 100 / 4096) = int(100.24)
    assert (reference_blocks(0), reference_blocks(15), reference_blocks(16), reference_blocks(17)) == (1, 1, 2, 2)


def test_first_request_opens_a_held_window_and_an_empty_instance_takes_it():
    mac = ref(hold=None)  # reference mode holds output by default
    acts = route(mac, "a", 500, {})
    assert acts[:2] == [OpenWindow(0), HoldOutput(0)] and isinstance(acts[2], SetTimer)
    assert acts[2].time == pytest.approx(11.5) and dispatched(acts) == [0]


def test_stays_while_the_smallest_budget_exceeds_need_time():
    mac = ref()
    mac.switch_to(0, now=10.0)  # window start 10,000 ms
    # decode slack: 10,000 + 10 iterations x 100 - 10,000 = 1,000 ms > need 500 + 300 (routed in the window)
    mac.mode.window_routed[0].append((300, 19))
    assert dispatched(route(mac, "a", 500, {0: st(0, [decoding("d", 10.0, 11)])})) == [0]


def test_switches_when_need_time_exceeds_ttft():
    mac = ref()
    mac.switch_to(0, now=10.0)
    mac.mode.window_routed[0].append((600, 38))
    acts = route(mac, "a", 500, {0: st(0, [decoding("d", 10.0, 11)])})  # need 1,100 > 1,000
    assert acts[:3] == [CloseWindow(0), ReleaseOutput(0), OpenWindow(1)] and dispatched(acts) == [1]
    assert mac.mode.window_routed[1] == [(500, reference_blocks(500))]  # the window restarts at the switch


@pytest.mark.parametrize("next_reqs,stays", [
    ([], False),  # the next instance has nothing: switch
    ([decoding("n", 10.0, 6)], True),  # its max slack 10,000 + 500 - 10,500 = 0 < 1,000 x 2/3: stay
    ([decoding("n", 10.0, 13)], False),  # 700 >= 666.7: it banked enough slack, switch
])
def test_next_instance_rule(next_reqs, stays):
    mac = ref()
    mac.switch_to(0, now=10.0)
    # budget 600 (10,000 + 6 x 100 - 10,000) < need 700 <= S_TTFT: the next instance decides
    statuses = {0: st(0, [decoding("d", 10.0, 7)]), 1: st(1, next_reqs)}
    assert dispatched(route(mac, "a", 700, statuses)) == [0 if stays else 1]


def test_a_pending_prefill_contributes_exactly_the_ttft_budget():
    mac = ref()
    mac.switch_to(0, now=10.0)
    pending = RequestState("p", 10.2, 100, None, 0)
    assert dispatched(route(mac, "a", 999, {0: st(0, [pending])})) == [0]  # 1,000 > 999
    mac2 = ref()
    mac2.switch_to(0, now=10.0)
    # need 1,000 is not < budget 1,000, and not > S_TTFT: next rule (instance 1 empty) -> switch
    assert dispatched(route(mac2, "a", 1000, {0: st(0, [pending])})) == [1]


def test_memory_check_in_blocks():
    mac = ref()
    mac.switch_to(0, now=10.0)
    free10 = {0: st(0, free=160)}  # 10 blocks of 16
    assert dispatched(route(mac, "a", 150, free10)) == [0]  # (150 + 16) // 16 = 10 blocks
    mac2 = ref()
    mac2.switch_to(0, now=10.0)
    assert dispatched(route(mac2, "a", 160, free10)) == [1]  # 11 blocks: switch, unconditionally


def test_output_hold_released_at_the_switch_and_at_ttft():
    mac = ref()
    acts = route(mac, "a", 100, {}, now=10.0)
    timer = next(a for a in acts if isinstance(a, SetTimer))
    assert mac.on_timer(timer.name) == [ReleaseOutput(0)]  # S_TTFT after it became the prefill instance
    mac.mode.window_routed[0].append((2000, 1))  # force a switch
    acts = route(mac, "b", 100, {0: st(0, [RequestState("a", 10.0, 100, None, 0)])}, now=11.2)
    assert acts[:3] == [CloseWindow(0), OpenWindow(1), HoldOutput(1)]  # 0 was released by its timer already
    acts = route(mac, "c", 2000, {1: st(1, [RequestState("b", 11.2, 100, None, 0)])}, now=11.3)
    assert acts[:4] == [CloseWindow(1), ReleaseOutput(1), OpenWindow(2), HoldOutput(2)]  # released at the close
    assert mac.on_timer(timer.name) == []
