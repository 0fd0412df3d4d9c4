"""The batch a policy assembles in one step, and which running requests are prefilling or decoding.

Policies and the scheduler's mechanism both build on this module; it imports neither. The rule for
a prefill is `interface.is_prefill`; the functions below run per request per step and spell it
inline (a function call there costs ~3% of simulator time); tests/sched checks they agree with it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ecoserve.request import Request
from ecoserve.sched.interface import ScheduledChunk

_new_chunk = tuple.__new__  # ScheduledChunk(...) without the NamedTuple's Python-level __new__ frame


def next_is_prefill(req: Request) -> bool:
    """Is this running request's next chunk a prefill (`is_prefill`)? Tokens are left beyond its newest one."""
    return len(req.all_token_ids) - req.num_computed_tokens > 1


def prefilling(reqs) -> list[Request]:
    """The requests whose next chunk is a prefill (`is_prefill`): tokens left beyond the newest one."""
    # is_prefill(tokens left, True): a full next chunk samples; a cut one is a prefill anyway
    return [r for r in reqs if len(r.all_token_ids) - r.num_computed_tokens > 1]


def decoding(reqs) -> list[Request]:
    """The complement of `prefilling`, in order: exactly the newest token left to compute."""
    return [r for r in reqs if len(r.all_token_ids) - r.num_computed_tokens <= 1]


@dataclass
class StepBuilder:
    """The batch being assembled this step: chunks in order and the budget left."""

    token_budget: int
    seq_budget: int
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)
    num_preempted: int = 0
    num_prefill_chunks: int = 0  # chunks with `is_prefill`, kept as they come and go

    def add(self, req: Request, num_tokens: int, num_spec: int = 0) -> None:
        """`num_spec`: how many of `num_tokens` are the request's proposals (after its own tokens)."""
        start = req.num_computed_tokens
        num_own = num_tokens - num_spec
        samples = start + num_own == len(req.all_token_ids)
        self.chunks[req.request_id] = _new_chunk(ScheduledChunk, (req, start, num_tokens, samples, num_spec))
        if num_own != 1 or not samples:  # is_prefill(num_tokens - num_spec, samples)
            self.num_prefill_chunks += 1
        self.token_budget -= num_tokens
        self.seq_budget -= 1

    def remove(self, req: Request) -> None:
        chunk = self.chunks.pop(req.request_id, None)
        if chunk is not None:
            self.token_budget += chunk.num_tokens
            self.seq_budget += 1
            if chunk.is_prefill:
                self.num_prefill_chunks -= 1

    @property
    def has_prefill(self) -> bool:
        return self.num_prefill_chunks > 0

    def full(self) -> bool:
        return self.token_budget <= 0 or self.seq_budget <= 0
