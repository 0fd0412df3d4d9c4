"""Scheduling policies: small classes that decide *which* requests get tokens this step.

All of them run over the one mechanism in `Scheduler` (budget, KV allocation, preemption).
Registered by name; `SchedulerConfig.policy` picks one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ecoserve.sched import tdpipe  # noqa: F401  (registers "tdpipe")
from ecoserve.sched.policy import POLICIES, Policy, register
from ecoserve.sched.step import StepBuilder, decoding, prefilling

if TYPE_CHECKING:  # the scheduler imports this module; policies only receive one
    from ecoserve.sched.scheduler import Scheduler


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()


def _admit_waiting(sched: "Scheduler", step: StepBuilder, whole_prompts: bool) -> None:
    """FCFS admission; stop at the first request that does not fit (no overtaking, except past requests whose
    LoRA adapter has no slot)."""
    while sched.waiting and not step.full():
        req = sched.next_waiting()
        if req is None:
            break
        remaining = req.num_tokens - req.num_computed_tokens
        if whole_prompts and step.chunks and remaining > step.token_budget:
            break  # a prompt is split only when it alone exceeds the budget
        if not sched.admit(req, step):
            break


@register("prefill_first")
class PrefillFirst(Policy):
    """vLLM (V0) style: a step is either all prefills or all decodes; waiting prefills go first.

    Prompts are not mixed with decodes, and a prompt is chunked only if it alone exceeds the
    token budget (its chunks then keep priority until the prompt is done).
    """

    def schedule(self, sched: "Scheduler", step: StepBuilder) -> None:
        for req in prefilling(sched.running):
            if step.full() or not sched.schedule_running(req, step):
                break
        if not step.chunks:
            _admit_waiting(sched, step, whole_prompts=True)
        if step.chunks:
            return
        sched.schedule_running_all(list(sched.running), step)


@register("chunked")
class ChunkedPrefill(Policy):
    """Sarathi style: decodes first, then ongoing prompt chunks, then new prompts, in one hybrid batch."""

    def schedule(self, sched: "Scheduler", step: StepBuilder) -> None:
        # Preempted requests (for an older one) are skipped.
        sched.schedule_running_all(decoding(sched.running) + prefilling(sched.running), step)
        if not step.num_preempted:  # memory is short: let running requests finish first
            _admit_waiting(sched, step, whole_prompts=False)


@register("temporal")
class TemporalDisaggregation(Policy):
    """EcoServe's instance policy: the window's prompts first, all together; otherwise decode.

    Every prompt queued at a step boundary that the window admits (`Scheduler.window`) goes into
    the step, chunked to fill `max_num_batched_tokens`, so k prompts take ceil(tokens / budget)
    steps; decodes wait meanwhile and resume when none is pending. A new prompt never starts
    outside a window (the macro-instance scheduler opens and closes them: `open_window` /
    `close_window`); a preempted request recomputes whenever it can, as it was admitted already.
    """

    def schedule(self, sched: "Scheduler", step: "StepBuilder") -> None:
        for req in prefilling(sched.running):  # prompts a window admitted, chunk after chunk
            if step.full() or not sched.schedule_running(req, step):
                break
        window = sched.window
        while sched.waiting and not step.full():
            req = sched.next_waiting()
            if req is None:
                break
            resumed = req.times.first_scheduled is not None  # preempted: recomputes whenever it can
            if not (resumed or window.may_admit(req.request_id)) or not sched.admit(req, step):
                break
        if step.chunks:
            return
        sched.schedule_running_all(list(sched.running), step)
