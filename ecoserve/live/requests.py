"""A request as the frontend tracks it: its client stream, where it runs, and its output so far.

Deltas from instances are folded into per-sample histories here and handed to the client as
`RequestOutput`s, so the OpenAI handlers read the same objects as from a single engine. A started
request whose instance is lost can move on (a migration): its input is then the prompt plus its
output so far, and its stream continues where the client's left off.

Two clocks per request: `first_token`/`last_token` are when tokens came from its instance,
`first_delivery`/`last_delivery` when they reached the client's queue. They differ only under the
output hold; the metrics the client is shown (`RequestMetrics`, hence the Prometheus TTFT) use the
delivery times, as the simulator's records do (see `ecoserve.sim.metrics`).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from ecoserve.live.messages import Delta
from ecoserve.request import CompletionOutput, Logprobs, OutputHistory, RequestMetrics, RequestOutput
from ecoserve.sampling import SamplingParams


@dataclass
class Sample:
    """One sample's history (what the client has been given) and the news not yet handed out."""

    history: OutputHistory = field(default_factory=OutputHistory)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None
    base_logprob: float = 0.0  # what earlier instances contributed (FuDG: the prefill's first token)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class LiveRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    deadline: float
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | BaseException
    samples: list[Sample] = field(default_factory=list)
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    instance: int | None = None
    continues: bool = False  # dispatched with a lower token limit: a stop at that limit is not the end
    transfer: int | None = None  # the KV transfer in flight (FuDG)
    kv_src: int | None = None  # the prefill instance that holds its KV pinned
    kv_dst: int | None = None  # the instance its KV was imported into
    pending: object | None = None  # a decode Dispatch waiting for its KV to arrive
    reroutes: int = 0
    lost_from: int | None = None  # its instance was lost: a re-route (or, once started, a migration) is due
    migrations: int = 0  # times its stream moved on after its instance was lost
    first_scheduled: float | None = None
    first_token: float | None = None  # from its instance
    last_token: float | None = None
    first_delivery: float | None = None  # into the client's queue
    last_delivery: float | None = None
    finished: float | None = None
    done: bool = False
    held: list[RequestOutput] = field(default_factory=list)  # outputs kept from the client (output hold)
    lora: Any = None  # the LoRARequest it runs with; None: the base model

    def __post_init__(self) -> None:
        self.samples = [Sample() for _ in range(self.params.n)]

    @property
    def num_output_tokens(self) -> int:
        s = self.samples[0]
        return len(s.history.token_ids) + len(s.new_token_ids)

    def output_token_ids(self) -> list[int]:
        s = self.samples[0]
        return s.history.token_ids + s.new_token_ids

    def num_output_chars(self) -> int:
        """Characters of text the client has been given (or that wait in the output hold)."""
        s = self.samples[0]
        return s.history.num_chars + len(s.new_text)

    @property
    def streamed(self) -> bool:
        """Has the client seen any token? (Then it moves on only as a migration.)"""
        return self.first_token is not None

    def migration_refusal(self, max_migrations: int, max_model_len: int) -> str | None:
        """Why this started request cannot continue on another instance, or None when it can."""
        p = self.params
        if p.n > 1:
            return "a request with n > 1 does not migrate (its samples have different outputs so far)"
        if p.frequency_penalty or p.presence_penalty:
            return ("a request with frequency or presence penalties does not migrate (they count output tokens, "
                    "which the continued request holds in its prompt)")
        if self.migrations >= max_migrations:
            return f"it has moved {self.migrations} time(s) already (at most {max_migrations}: --max-migrations)"
        if self.remaining_tokens(max_model_len) <= 0:
            return "it has no token budget left"
        return None

    def begin_migration(self, lost_from: int) -> None:
        """Its instance was lost: forget where it ran and what moved; its logprob sum so far is the base."""
        self.migrations += 1
        self.lost_from = lost_from
        self.transfer = self.pending = self.kv_src = self.kv_dst = None
        self.continues = False
        s = self.samples[0]
        s.base_logprob = s.cumulative_logprob or 0.0

    def remaining_tokens(self, max_model_len: int) -> int:
        room = max_model_len - len(self.prompt_token_ids) - self.num_output_tokens
        limit = self.params.max_tokens
        return room if limit is None else min(limit - self.num_output_tokens, room)

    def apply(self, d: Delta, now: float) -> bool:
        """Fold one delta in; True when the sample reached its real end (not a stop at a dispatch limit)."""
        s = self.samples[d.index] if d.index < len(self.samples) else None
        if s is None:
            return False
        if d.token_ids:
            if self.first_token is None:
                self.first_token = now
            self.last_token = now
        s.new_token_ids.extend(d.token_ids)
        s.new_text += d.text
        if d.logprobs is not None:
            s.new_logprobs = (s.new_logprobs or []) + list(d.logprobs)
        if d.cumulative_logprob is not None:
            s.cumulative_logprob = s.base_logprob + d.cumulative_logprob
        if d.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.num_cached_tokens and not self.num_cached_tokens:
            self.num_cached_tokens = d.num_cached_tokens
        if d.finish_reason is None:
            return False
        if self.continues and d.finish_reason == "length":
            s.base_logprob = s.cumulative_logprob or 0.0
            return False
        s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason
        return True

    @property
    def all_finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def output(self) -> RequestOutput:
        """The news since the previous output, as the engine's delta outputs carry it (histories shared)."""
        outs = []
        for i, s in enumerate(self.samples):
            wants_logprobs = self.params.logprobs is not None
            new_logprobs = s.new_logprobs if s.new_logprobs is not None else ([] if wants_logprobs else None)
            if wants_logprobs and s.history.logprobs is None:
                s.history.logprobs = []
            s.history.extend(s.new_token_ids, s.new_text, new_logprobs)
            outs.append(CompletionOutput(i, s.new_text, s.new_token_ids, s.cumulative_logprob, new_logprobs,
                                         s.finish_reason, s.stop_reason, s.history))
            s.new_token_ids, s.new_text, s.new_logprobs = [], "", None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs, outs,
                             self.all_finished, self.metrics(), self.num_cached_tokens)

    def metrics(self) -> RequestMetrics:
        """The client's view: token times are when tokens reached it (held ones at their flush)."""
        return RequestMetrics(self.arrival, self.first_scheduled, self.first_delivery, self.last_delivery,
                              self.finished)

    def hand_out(self, outputs: list[RequestOutput], now: float) -> None:
        """These outputs reach the client now: stamp the delivery times, into their metrics too."""
        if any(c.new_token_ids for o in outputs for c in o.outputs):
            if self.first_delivery is None:
                self.first_delivery = now
            self.last_delivery = now
        for o in outputs:
            o.metrics = self.metrics()
            self.outputs.put_nowait(o)
