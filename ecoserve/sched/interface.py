"""The typed contract between a scheduler and whatever executes its batches.

A real executor runs the model (ecoserve.engine.model_runner); a simulated one predicts the step
time from a performance model (ecoserve.sim). Schedulers see only this interface and a Clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ecoserve.request import Logprobs, Request


def is_prefill(num_tokens: int, samples: bool) -> bool:
    """The one rule for "is this a prefill": a chunk is a decode exactly when it computes one token, the
    request's newest, and samples after it. Prompt chunks, whole prompts and recomputation after a
    preemption are prefills, whatever their length."""
    return num_tokens != 1 or not samples


class ScheduledChunk(NamedTuple):
    """Compute KV for tokens [start, start + num_tokens) of `request`; sample if that reaches its end.

    Immutable like the other messages; a NamedTuple rather than a frozen dataclass because one is
    built per request per step and a frozen dataclass costs twice as much to construct.
    """

    request: Request
    start: int
    num_tokens: int
    samples: bool  # fixed at scheduling time: this chunk reaches the request's last token
    # speculative decoding: the last `num_spec_tokens` of `num_tokens` are the request's proposals (spec_token_ids)
    num_spec_tokens: int = 0

    @property
    def is_prefill(self) -> bool:
        return is_prefill(self.num_tokens - self.num_spec_tokens, self.samples)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    # request_id -> KV block ids covering every scheduled token; live lists, valid until the next schedule()
    block_tables: dict[str, list[int]]
    finished_ids: tuple[str, ...] = ()  # requests that left since the previous step (executors drop their state)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class StepResult:
    """What an executor returns: one sampled token per sampling chunk, and the step's duration.

    `duration` is the measured (real) or predicted (simulated) execution time in seconds.
    """

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)  # top-N (+ sampled) logprobs of the sampled token
    sampled_logprob: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)  # appended chunk by chunk
    duration: float = 0.0
    # speculative decoding, for chunks with proposals: every token the request emits this step in order (its
    # accepted proposals, then the target's own token; `sampled` holds the first), and their logprobs if asked
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    spec_sampled_logprobs: dict[str, list[float]] = field(default_factory=dict)


class Executor(Protocol):
    def execute(self, batch: SchedulerOutput) -> StepResult: ...
