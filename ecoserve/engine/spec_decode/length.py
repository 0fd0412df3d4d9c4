"""How many tokens each decoding request proposes this step: the engine's one question to a length policy.

The engine hands a policy what it measures (the running batch size, each request's acceptance so far, its own
step time by token count) and gets a k per request; 0 means no speculation for that request this step.
`FixedLength` is the configured `num_speculative_tokens`; `num_speculative_tokens: "auto"` plugs a tuner in
at the same place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Acceptance:
    """One request's verification record so far."""

    num_drafts: int = 0  # steps that verified proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def rate(self) -> float | None:
        """Accepted over proposed tokens; None before any proposal was verified."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted


@dataclass
class StepTimes:
    """The engine's measured step time by the step's token count: an exponential moving average per count."""

    smoothing: float = 0.2
    seconds: dict[int, float] = field(default_factory=dict)

    def add(self, num_tokens: int, seconds: float) -> None:
        old = self.seconds.get(num_tokens)
        self.seconds[num_tokens] = seconds if old is None else old + self.smoothing * (seconds - old)

    def get(self, num_tokens: int) -> float | None:
        return self.seconds.get(num_tokens)


@dataclass(frozen=True)
class LengthQuery:
    """What a policy may read for one request in one step."""

    request_id: str
    batch_size: int  # requests running (decoding or not)
    max_tokens: int  # the most this request can use (its remaining output, the configured k)
    acceptance: Acceptance
    step_times: StepTimes


class SpeculationLength(Protocol):
    def choose(self, query: LengthQuery) -> int:
        """Tokens to propose for `query.request_id` this step, 0..query.max_tokens."""


@dataclass(frozen=True)
class FixedLength:
    """Always `k` (the configured num_speculative_tokens), none once more than `disable_by_batch_size` run."""

    k: int
    disable_by_batch_size: int | None = None

    def choose(self, query: LengthQuery) -> int:
        if self.disable_by_batch_size is not None and query.batch_size > self.disable_by_batch_size:
            return 0
        return min(self.k, query.max_tokens)
