"""What an instance reports to the cluster layer, and the one function that builds it.

`instance_status(instance_id, scheduler)` is the only producer of `InstanceStatus`: the simulator
calls it on its simulated instances, the live instance process on its engine's scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

from ecoserve.states import Phase

if TYPE_CHECKING:
    from ecoserve.sched.scheduler import Scheduler


class RequestState(NamedTuple):
    """One request as its instance reports it (a NamedTuple: one is built per request per report)."""

    request_id: str
    routed_time: float  # when this instance received it (the paper's per-request "arrival")
    prompt_len: int
    first_token_time: float | None
    num_output_tokens: int
    tokens_at_switch: int = 0  # output tokens it had when the instance's current (or last) window opened


@dataclass(frozen=True)
class InstanceStatus:
    """One instance's state as of `time`.

    `t_switch` is when the instance's current (or last) prefill window opened (`window_start`;
    the instance's creation before its first window): requests routed at or after it are the
    window's prefills, older ones are decoding (Algorithm 1). `free_kv_tokens` is net of prompts
    still queued inside it. `phase` is `Scheduler.phase`.
    """

    instance_id: int
    time: float
    phase: Phase
    t_switch: float
    requests: tuple[RequestState, ...]
    free_kv_tokens: int
    total_kv_tokens: int
    # the defaults keep hand-built statuses short
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 1 << 30
    window_open: bool = False
    window_start: float | None = None  # None: no window was ever commanded
    loras: tuple[str, ...] = ()  # the LoRA adapters loaded on the instance (registered, ready to run)
    free_lora_slots: int = 1 << 30  # more adapters its running batch may take (--max-loras less those running)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def free_seats(self) -> int:
        return self.max_num_seqs - self.num_running - self.num_waiting


def holds_adapter(st: InstanceStatus, lora_name: str, prompt_len: int) -> bool:
    """Adapter affinity: `st` holds the adapter and has room for the request (a seat and its prompt's KV)."""
    return lora_name in st.loras and st.free_seats >= 1 and st.free_kv_tokens >= prompt_len


def prefer_holders(candidates: list[int], lora_name: str | None, prompt_len: int, status_of: "StatusOf") -> list[int]:
    """The candidates that hold `lora_name` with room for the request and no more than their share of the
    requests (the mean over the candidates, plus one: a popular adapter spreads instead of piling onto its
    first holder), in the given order; else those with a free adapter slot (a request for a new adapter
    would wait on the others); all of them when none is, or the request runs on the base model."""
    if lora_name is None:
        return candidates
    statuses = {i: status_of(i) for i in candidates}
    share = sum(st.num_requests for st in statuses.values()) / max(len(candidates), 1) + 1
    holders = [i for i in candidates
               if holds_adapter(statuses[i], lora_name, prompt_len) and statuses[i].num_requests <= share]
    if holders:
        return holders
    return [i for i in candidates if statuses[i].free_lora_slots > 0] or candidates


StatusOf = Callable[[int], InstanceStatus]  # a driver's reader of the freshest status of an instance


def instance_status(instance_id: int, sched: "Scheduler", loras: tuple[str, ...] = ()) -> InstanceStatus:
    """Snapshot a scheduler: running requests first, then queued ones (with their KV still to come);
    `loras`: the adapters the instance holds."""
    win = sched.window
    tas = win.tokens_at_open
    reqs = [RequestState(r.request_id, r.times.arrival, len(r.prompt_token_ids), r.times.first_token,
                         len(r.output_token_ids), tas.get(r.request_id, 0)) for r in sched.running]
    queued = 0
    for r in sched.waiting:
        reqs.append(RequestState(r.request_id, r.times.arrival, len(r.prompt_token_ids), r.times.first_token,
                                 len(r.output_token_ids)))
        queued += len(r.all_token_ids) + 1
    kv = sched.kv
    bs = kv.block_size
    start = win.opened_at
    return InstanceStatus(instance_id, sched.clock.now(), sched.phase,
                          start if start is not None else sched.created_at, tuple(reqs),
                          kv.num_free_blocks * bs - queued, kv.num_blocks * bs,
                          len(sched.running), len(sched.waiting), sched.config.max_num_seqs,
                          win.is_open and start is not None, start, loras,
                          sched.max_loras - len(sched.running_loras) if sched.max_loras is not None else 1 << 30)
