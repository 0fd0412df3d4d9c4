"""The engine's side of speculative decoding: proposals before each step, counters and measurements after it.

Before scheduling, every running request whose next chunk is a decode gets `spec_token_ids` (possibly none):
its length policy says how many, the proposer says which. The scheduler puts them in that request's decode
chunk; the model runner verifies them (`verify.verify`); after the step, `record` counts drafts and accepted
tokens (vLLM's spec_decode_* counters) and feeds the measured step time back to the length policy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ecoserve.config import SpeculativeConfig
from ecoserve.engine.spec_decode.length import Acceptance, FixedLength, LengthQuery, SpeculationLength, StepTimes
from ecoserve.engine.spec_decode.ngram import NgramProposer
from ecoserve.request import Request
from ecoserve.sched.interface import SchedulerOutput, StepResult

# num_speculative_tokens "auto" runs with this fixed k where no tuner is installed
AUTO_FALLBACK_TOKENS = 3


@dataclass
class SpecDecodeCounters:
    """vLLM's spec_decode_* counters: monotonic, engine-wide."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: steps whose proposal i was accepted

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verifying step (accepted + the target's own), vLLM's "mean acceptance length"."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def make_length(config: SpeculativeConfig) -> SpeculationLength:
    """The configured k, or for "auto" the tuner."""
    k = config.num_speculative_tokens
    if k == "auto":
        from ecoserve.engine.spec_decode.tuner import TunedLength

        return TunedLength()
    return FixedLength(k, config.disable_by_batch_size)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer, length: SpeculationLength | None = None) -> None:
        """proposer: `NgramProposer` (one request at a time) or `DraftModelProposer` (a batch at once)."""
        self.config = config
        self.proposer = proposer
        self.length = length or make_length(config)
        self.max_tokens = getattr(self.length, "max_tokens", AUTO_FALLBACK_TOKENS) \
            if config.num_speculative_tokens == "auto" else config.num_speculative_tokens
        self.counters = SpecDecodeCounters()
        self.step_times = StepTimes()
        self.acceptance: dict[str, Acceptance] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}

    @classmethod
    def ngram(cls, config: SpeculativeConfig) -> "Speculator":
        return cls(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))

    def propose(self, running: Sequence[Request], trim: Callable[[str, list[int]], int] | None = None) -> None:
        """Set `spec_token_ids` of every running request (empty where it does not speculate this step).

        trim(request_id, proposals): how many of them to keep (a grammar's valid prefix)."""
        self._draft_probs = {}
        batch = len(running)
        queries: list[tuple[Request, LengthQuery]] = []
        for req in running:
            req.spec_token_ids = []
            if len(req.all_token_ids) - req.num_computed_tokens != 1:
                continue  # a prompt chunk or a recompute: nothing to verify yet
            room = req.max_output_tokens - req.num_output_tokens - 1  # the target adds one token of its own
            if room <= 0:
                continue
            acceptance = self.acceptance.get(req.request_id)
            if acceptance is None:
                acceptance = self.acceptance[req.request_id] = Acceptance()
            queries.append((req, LengthQuery(req.request_id, batch, min(room, self.max_tokens), acceptance,
                                              self.step_times)))
        choose_all = getattr(self.length, "choose_all", None)  # a policy that plans the step's decodes together
        ks = choose_all([q for _, q in queries]) if choose_all else [self.length.choose(q) for _, q in queries]
        wants = [(req, k) for (req, _), k in zip(queries, ks) if k > 0]
        if not wants:
            return
        batched = getattr(self.proposer, "propose_batch", None)
        if batched is not None:
            started = time.perf_counter()
            proposals = batched(wants)
            observe = getattr(self.length, "observe_draft", None)  # the tuner weighs the draft's cost
            if observe is not None:
                observe(len(wants), max(k for _, k in wants), time.perf_counter() - started)
        else:
            proposals = [(self.proposer.propose(req, k), None) for req, k in wants]
        for (req, _), (tokens, probs) in zip(wants, proposals):
            if trim is not None and tokens:
                tokens = tokens[:trim(req.request_id, tokens)]
            req.spec_token_ids = tokens
            if probs is not None and tokens:
                self._draft_probs[req.request_id] = probs[:len(tokens)]

    def draft_probs(self) -> dict[str, torch.Tensor] | None:
        """The draft's distributions of this step's proposals, per request ([k, vocab]); None for one-hot ones."""
        return self._draft_probs or None

    def record(self, out: SchedulerOutput, result: StepResult) -> None:
        """Count the step's verifications and keep its measured duration by token count."""
        num_tokens = 0
        for chunk in out.chunks:
            num_tokens += chunk.num_tokens
            if not chunk.num_spec_tokens:
                continue
            tokens = result.spec_tokens.get(chunk.request.request_id)
            if tokens is None:
                continue
            accepted = len(tokens) - 1
            self.counters.add(chunk.num_spec_tokens, accepted)
            acceptance = self.acceptance.get(chunk.request.request_id)
            if acceptance is not None:
                acceptance.add(chunk.num_spec_tokens, accepted)
        if num_tokens:
            self.step_times.add(num_tokens, result.duration)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop the state of requests that left."""
        for rid in request_ids:
            self.acceptance.pop(rid, None)
        for part in (self.proposer, self.length):
            forget = getattr(part, "forget", None)
            if forget is not None:
                forget(request_ids)


def build_speculator(config, loaded, num_blocks: int) -> Speculator:
    """The engine's speculator for `config.speculative` (an `EngineConfig`); refuses what it cannot run."""
    spec = config.speculative
    parallel = config.parallel
    if parallel.world_size > 1 or parallel.batches_in_flight > 1:
        raise ValueError("speculative decoding runs in a single-process instance with one batch in flight; it is "
                         f"not supported with tensor_parallel_size {parallel.tensor_parallel_size}, "
                         f"pipeline_parallel_size {parallel.pipeline_parallel_size} and max_concurrent_batches "
                         f"{parallel.batches_in_flight}")
    if spec.method == "ngram":
        return Speculator.ngram(spec)
    from ecoserve.engine.spec_decode.draft import DraftModelProposer

    return Speculator(spec, DraftModelProposer.load(config, loaded, num_blocks))
