"""The `temporal` policy: prompts only inside router-commanded windows, all together, then decodes."""
import math

from ecoserve.clock import VirtualClock
from ecoserve.cluster import instance_status
from ecoserve.config import CacheConfig, SchedulerConfig
from ecoserve.request import Request
from ecoserve.sampling import SamplingParams
from ecoserve.sched import Scheduler, StepResult


def make(budget=64, blocks=200, max_seqs=256):
    clock = VirtualClock()
    sched = Scheduler(SchedulerConfig(policy="temporal", max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                      CacheConfig(block_size=4, enable_prefix_caching=False), blocks, clock, max_model_len=400)
    return sched, clock


def add(sched, rid, n, out=4):
    sched.add_request(Request(rid, [1] * n, SamplingParams(max_tokens=out, ignore_eos=True), 0.0))


def step(sched, clock):
    out = sched.schedule()
    clock.advance_to(clock.now() + 0.01)
    sched.update(out, StepResult(sampled={c.request.request_id: 7 for c in out.chunks if c.samples}))
    return out


def test_no_prompt_runs_outside_a_window():
    sched, clock = make()
    sched.close_window()
    add(sched, "a", 10)
    for _ in range(3):
        assert step(sched, clock).is_empty  # queued, but no window
    assert sched.open_window()
    out = step(sched, clock)
    assert [c.request.request_id for c in out.chunks] == ["a"] and out.chunks[0].is_prefill


def test_queued_prompts_run_together_in_ceil_tokens_over_budget_steps_then_decodes_resume():
    sched, clock = make(budget=64)
    sched.close_window()
    add(sched, "d", 5, out=50)
    sched.open_window()
    step(sched, clock)  # "d" prefilled; it decodes from now on
    sched.close_window()
    lens = [30, 50, 40, 20]  # 140 tokens: ceil(140 / 64) = 3 steps
    for i, n in enumerate(lens):
        add(sched, f"p{i}", n)
    assert not any(c.is_prefill for c in step(sched, clock).chunks)  # closed: "d" decodes alone
    sched.open_window()
    prefill_steps = 0
    while True:
        out = step(sched, clock)
        if not any(c.is_prefill for c in out.chunks):
            break
        assert all(c.is_prefill for c in out.chunks)  # decodes wait while the window's prompts run
        prefill_steps += 1
    assert prefill_steps == math.ceil(sum(lens) / 64)
    assert {c.request.request_id for c in out.chunks} == {"d", "p0", "p1", "p2", "p3"}  # decodes resume


def test_prompts_routed_in_a_window_still_run_after_it_closes():
    sched, clock = make()
    sched.close_window()
    sched.open_window()
    add(sched, "a", 10)
    sched.close_window()  # the router moved on before the instance's next step boundary
    add(sched, "late", 10)  # after the close: waits for the next window
    out = step(sched, clock)
    assert [c.request.request_id for c in out.chunks] == ["a"]
    assert not any(c.request.request_id == "late" and c.is_prefill for c in step(sched, clock).chunks)


def test_window_commands_are_recorded_and_reported():
    sched, clock = make(max_seqs=8)
    sched.close_window()  # the uncommanded start-up window is not counted
    assert sched.window.num_windows == 0 and sched.phase == "idle"
    add(sched, "a", 10, out=20)
    clock.advance_to(1.0)
    sched.open_window()
    assert not sched.open_window()  # already open
    step(sched, clock)
    step(sched, clock)
    clock.advance_to(2.5)
    sched.close_window()
    assert sched.window.num_windows == 1 and sched.window.mean_open_s() == 1.5
    add(sched, "b", 6)
    st = instance_status(3, sched)
    assert (st.instance_id, st.phase, st.t_switch, st.window_start, st.window_open) == (3, "decode", 1.0, 1.0, False)
    assert (st.num_running, st.num_waiting, st.max_num_seqs, st.free_seats) == (1, 1, 8, 6)
    a, b = st.requests
    assert (a.request_id, a.num_output_tokens, a.tokens_at_switch, a.first_token_time) == ("a", 2, 0, 1.01)
    assert b.first_token_time is None
    assert st.free_kv_tokens == (200 - 3) * 4 - (6 + 1)  # a holds 12 tokens = 3 blocks; b's prompt is queued
