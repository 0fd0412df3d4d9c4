"""Speculative decoding in a simulated instance: proposals, their verification cost and random acceptance.

The live scheduler schedules the proposals (a decode chunk carries them, the token budget counts them) and
takes the accepted tokens; this module only stands in for the proposer and the rejection sampler. Each
proposal is accepted with probability `acceptance_rate` given the ones before it were (the tuner's model),
drawn from a seeded generator. A draft model costs `draft_cost` of the target's plain decode step per draft
pass (pass j runs over the requests proposing at least j tokens); n-gram lookup costs nothing (0).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ecoserve.engine.spec_decode.tuner import plan
from ecoserve.sched.interface import StepResult
from ecoserve.sim.instance import SimulatedExecutor
from ecoserve.sim.lora import AdapterCache
from ecoserve.sim.perf import StepWork

AUTO = "auto"


@dataclass(frozen=True)
class SpeculationModel:
    """`num_speculative_tokens`: k per decode, or "auto" (the tuner's `plan` over the instance's own perf model)."""

    acceptance_rate: float
    num_speculative_tokens: int | str = 3
    draft_cost: float = 0.0  # one draft pass / the target's decode step of the same requests (0: n-gram)
    max_auto_tokens: int = 8  # "auto": the most proposals per request and step
    seed: int = 0

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not (k == AUTO or (isinstance(k, int) and not isinstance(k, bool) and k >= 1)):
            raise ValueError(f"num_speculative_tokens must be an integer >= 1 or \"auto\", got {k!r}")
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError(f"the acceptance rate must be in [0, 1], got {self.acceptance_rate}")
        if self.draft_cost < 0:
            raise ValueError(f"the draft cost must be >= 0 (a fraction of a target decode step), got {self.draft_cost}")
        if self.max_auto_tokens < 1:
            raise ValueError(f"max_auto_tokens must be >= 1, got {self.max_auto_tokens}")


class SpeculatingExecutor(SimulatedExecutor):
    """A `SimulatedExecutor` whose decodes verify proposals (`propose` before each `Scheduler.schedule`)."""

    def __init__(self, perf, model: SpeculationModel, token_id: int = 0, adapters: AdapterCache | None = None) -> None:
        super().__init__(perf, token_id, adapters)
        self.model = model
        self._rng = random.Random(model.seed)
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def propose(self, running: list) -> None:
        """Give each running decode its proposals for the coming step (at most its remaining output less one)."""
        decodes = [r for r in running if r.num_computed_tokens == len(r.all_token_ids) - 1]
        if not decodes:
            return
        k = self.model.num_speculative_tokens
        caps = [max(min(self.model.max_auto_tokens if k == AUTO else k,
                        r.sampling_params.max_tokens - r.num_output_tokens - 1), 0) for r in decodes]
        if k == AUTO:
            caps = plan([self.model.acceptance_rate] * len(decodes), caps, self._step_seconds(decodes),
                        draft_seconds=self._draft_seconds(decodes) if self.model.draft_cost else None)
        token = self.token_id
        for r, n in zip(decodes, caps):
            r.spec_token_ids = [token] * n

    def _step_seconds(self, decodes: list):
        """A step of these decodes plus n - len(decodes) proposals, each reading the mean context."""
        b = len(decodes)
        context = sum(r.num_computed_tokens for r in decodes) / b
        return lambda n: self.perf.work_time(StepWork(n, b, n, n * (context + 1) + (n - b), n * (context + 1)))

    def _draft_seconds(self, decodes: list):
        context = sum(r.num_computed_tokens for r in decodes) / len(decodes)
        cost = self.model.draft_cost
        return lambda n: cost * self.perf.work_time(StepWork(n, n, n, n * (context + 1), n * (context + 1)))

    def verify(self, chunks: list, result: StepResult) -> None:
        """Accept each chunk's proposals at random (the model's rate) and add the draft passes' time."""
        token_id, alpha, rng = self.token_id, self.model.acceptance_rate, self._rng
        passes: list[int] = []  # passes[j - 1]: requests drafting at least j tokens
        context = 0
        for c in chunks:
            spec = c.num_spec_tokens
            accepted = 0
            while accepted < spec and rng.random() < alpha:
                accepted += 1
            result.spec_tokens[c.request.request_id] = [token_id] * (accepted + 1)
            self.num_drafts += 1
            self.num_draft_tokens += spec
            self.num_accepted_tokens += accepted
            passes.extend([0] * (spec - len(passes)))
            for j in range(spec):
                passes[j] += 1
            context += c.start + 1
        if self.model.draft_cost:
            context /= len(chunks)
            work = self.perf.work_time
            result.duration += self.model.draft_cost * sum(work(StepWork(n, n, n, n * context, n * context))
                                                           for n in passes)
