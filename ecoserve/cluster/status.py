"""What an instance reports to the cluster layer: a frozen snapshot, cheap to ship (ZeroMQ live)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class RequestState(NamedTuple):
    """One request as its instance reports it (a NamedTuple: one is built per request per report)."""

    request_id: str
    routed_time: float  # when this instance received it (the paper's per-request "arrival")
    prompt_len: int
    first_token_time: float | None
    num_output_tokens: int
    tokens_at_switch: int = 0  # output tokens it had at the instance's last prefill->decode switch


@dataclass(frozen=True)
class InstanceStatus:
    """One instance's state as of `time`.

    `t_switch` is the time the instance last went from prefill to decode, i.e. the start of its
    current admission window: requests routed at or after it are the window's prefills; older
    ones are decoding (Algorithm 1). `free_kv_tokens` is net of prompts still queued inside it.
    """

    instance_id: int
    time: float
    phase: str  # "idle" | "prefill" | "decode"
    t_switch: float
    requests: tuple[RequestState, ...]
    free_kv_tokens: int
    total_kv_tokens: int

    @property
    def num_requests(self) -> int:
        return len(self.requests)
