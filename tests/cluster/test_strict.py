"""`paper-strict`: Algorithm 1 as printed (hand-computed): check (1) sums per-request predictions since the switch."""
import pytest

from ecoserve.cluster import InstanceStatus, MacroInstance, PrefillProfile, RequestState, RouterConfig
from ecoserve.cluster.events import CloseWindow, Dispatch, OpenWindow, SetTimer

# 0.1 s per prefill plus 1 ms per token: a sum of single prefills costs more than one batched prefill
PROFILE = PrefillProfile(lambda n: 0.1 + n / 1000, 4096)


def status(iid=0, queued=(), decoding=(), free=100_000, total=100_000, now=10.5, running=0, seats=256):
    """`queued`: prompt lengths not yet prefilled; `decoding`: (tokens, first token time), routed at t=0."""
    reqs = [RequestState(f"q{i}", 10.1, n, None, 0) for i, n in enumerate(queued)]
    reqs += [RequestState(f"d{i}", 0.0, 100, ft, tok) for i, (tok, ft) in enumerate(decoding)]
    return InstanceStatus(iid, now, "decode", 0.0, tuple(reqs), free, total, num_running=running or len(reqs),
                          max_num_seqs=seats)


def router(ids=(0, 1), mode="paper-strict", profile=PROFILE, **kw):
    cfg = dict(ttft_slo=1.0, tpot_slo=0.1, kv_reserve_frac=0.05)
    cfg.update(kw)
    return MacroInstance(list(ids), profile, RouterConfig(mode=mode, **cfg))


def empty(iid):
    return status(iid)


class Tracker:
    """A `status_of` whose instances still have to prefill every prompt dispatched to them."""

    def __init__(self) -> None:
        self.queued: dict[int, list[int]] = {}

    def note(self, acts: list, lengths: dict[str, int]) -> list:
        for a in acts:
            if isinstance(a, Dispatch):
                self.queued.setdefault(a.instance_id, []).append(lengths[a.request_id])
        return acts

    def submit(self, r: MacroInstance, rid: str, n: int, now: float) -> list:
        return self.note(r.submit(rid, n, 1, self, now=now), {rid: n})

    def __call__(self, iid: int) -> InstanceStatus:
        return status(iid, queued=self.queued.get(iid, ()))


def test_check1_sums_single_prefills_since_the_switch_where_the_batched_window_fits():
    r, st = router(), Tracker()
    for rid in "abcde":  # 5 x 0.2 s = 1.0 s == S_TTFT: all on instance 0
        st.submit(r, rid, 100, now=10.5)
    assert r.active == 0 and r.mode.routed_since_switch(r, 0) == pytest.approx([0.2] * 5)
    backlog = status(0, queued=[100] * 5)  # none of them prefilled yet
    c = r.check(backlog, 100, now=10.5)
    assert (c.ok, c.reason) == (False, "ttft") and c.window_prefill_time == pytest.approx(1.2)
    paper = router(mode="paper")
    paper.switch_to(0, now=10.5)
    assert paper.check(backlog, 100, now=10.5).ok  # today's batched rule: 0.1 + 0.6 = 0.7 s


def test_check1_counts_requests_already_prefilled_and_ignores_the_window_age():
    r = router()
    r.submit("a", 700, 1, empty, now=10.0)  # 0.8 s predicted
    done = status(0, now=12.0)  # "a" has finished; the window has been open 2 s
    assert r.check(done, 99, now=12.0).ok  # 0.8 + 0.199 <= 1.0: no window timer, no age term
    assert r.check(done, 101, now=12.0).reason == "ttft"  # 0.8 + 0.201


def test_one_instance_never_stalls_once_its_prefills_are_done():
    r, st = router([0]), Tracker()
    for rid in "abcde":
        st.submit(r, rid, 100, now=10.5)
    assert st.submit(r, "f", 100, now=10.5) == [] and len(r.pending) == 1  # 1.2 s > S_TTFT: waits
    st.queued.clear()  # the instance prefilled them all
    assert st.note(r.retry(st, now=11.0), {"f": 100}) == [Dispatch("f", 0, 1)]


def test_a_failing_check_moves_the_cursor_and_sets_no_close_timer():
    r, st = router([0, 1, 2]), Tracker()
    acts = []
    for rid in "abcdef":
        acts += st.submit(r, rid, 100, now=10.5)
    assert not [a for a in acts if isinstance(a, SetTimer)]
    assert acts[-3:] == [CloseWindow(0), OpenWindow(1), Dispatch("f", 1, 1)]
    assert r.candidate_order()[0] == 1 and r.mode.routed_since_switch(r, 1) == pytest.approx([0.2])
    assert r.mode.routed_since_switch(r, 0) == []  # its window closed: a new one starts from nothing
    assert r.on_timer("close/0/0/1") == [] and r.active == 1  # no timer closes a window


def test_a_prompt_longer_than_the_slo_goes_alone_to_a_fresh_window():
    r, st = router([0, 1]), Tracker()
    acts = st.submit(r, "big", 2000, now=10.5)  # 2.1 s on its own
    assert acts == [OpenWindow(0), Dispatch("big", 0, 1)]
    assert st.submit(r, "next", 10, now=10.6)[-1] == Dispatch("next", 1, 1)


def test_check2_compares_the_slack_with_the_sum():
    r = router(ttft_slo=2.0, profile=PrefillProfile(lambda n: n / 1000, 4096))
    r.submit("a", 600, 1, empty, now=10.5)
    st = status(0, queued=[600], decoding=[(10, 10.0), (20, 10.0)])  # mean saved TPOT 1.0 s (test_router's case)
    assert r.check(st, 400, now=10.5).ok  # 0.6 + 0.4 = 1.0
    c = r.check(st, 401, now=10.5)
    assert (c.ok, c.reason) == (False, "tpot") and c.window_prefill_time == pytest.approx(1.001)


def test_checks_3_and_4_still_apply():
    r = router()
    assert r.check(status(free=1000, total=10_000), 499, now=10.5).ok
    assert r.check(status(free=1000, total=10_000), 500, now=10.5).reason == "memory"
    assert r.check(status(running=4, seats=4), 10, now=10.5).reason == "seats"


def test_requests_that_fit_nowhere_wait_fifo_without_a_hold():
    r = router([0, 1])
    assert not r.config.holds_output
    full = lambda iid: status(iid, free=100, total=10_000)
    assert r.submit("a", 100, 1, full, now=10.5) == [] and r.submit("b", 10, 1, full, now=10.5) == []
    assert [p.request_id for p in r.pending] == ["a", "b"] and r.active is None
    out = r.retry(empty, now=10.7)
    assert [a for a in out if isinstance(a, Dispatch)] == [Dispatch("a", 0, 1), Dispatch("b", 0, 1)]


def test_the_output_hold_sets_only_its_release_timer():
    r = router([0, 1], output_hold=True)
    timers = [a for a in r.submit("a", 100, 1, empty, now=10.5) if isinstance(a, SetTimer)]
    assert [t.name.split("/")[0] for t in timers] == ["release"]


def test_prefill_alone_is_one_step_up_to_the_budget():
    p = PrefillProfile(lambda n: 0.02 + n / 1000, 512)
    assert p.alone(300) == pytest.approx(p.step_time(300))
    assert p.alone(1100) == pytest.approx(p.batched(1100))
