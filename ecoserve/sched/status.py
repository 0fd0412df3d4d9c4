"""Snapshots an instance reports upward (to the cluster layer, metrics and the simulator)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestProgress:
    request_id: str
    arrival_time: float
    first_token_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    status: str


@dataclass(frozen=True)
class SchedulerStatus:
    time: float
    phase: str  # "idle" | "prefill" | "decode"
    last_phase_switch: float
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    num_preemptions: int
    requests: tuple[RequestProgress, ...]

    @property
    def free_kv_tokens(self) -> int:
        return self.num_free_blocks * self.block_size
