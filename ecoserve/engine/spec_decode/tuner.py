"""The speculation-length tuner behind `num_speculative_tokens: "auto"` (ARCA's idea, our reading).

Each step it picks, per decoding request, how many tokens to propose (`k`, 0 = do not speculate) so that the
step's expected useful tokens per second of step time is highest. Pure Python over numbers: the engine's
measured step time by token count (`length.StepTimes`, kept by the speculator from every step it runs), and each
request's verifications; docs/speculation_tuner.md gives the model.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from ecoserve.engine.spec_decode.length import LengthQuery, StepTimes


def expected_tokens(k: int, alpha: float) -> float:
    """Tokens one verification emits on average with `k` proposals, each accepted with probability `alpha`
    given the ones before it were: 1 + alpha + ... + alpha^k (the accepted prefix plus the target's own token)."""
    if k < 0 or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"k must be >= 0 and alpha in [0, 1], got k={k}, alpha={alpha}")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def step_seconds(times: StepTimes):
    """Seconds of a step of n tokens read from the measured ones: linear between token counts, the first measured
    time below them, along the last two past them (never falling: noise must not make a bigger step look cheaper);
    None until two token counts were measured."""
    rows = sorted(times.seconds.items())
    if len(rows) < 2:
        return None
    xs, ys = [n for n, _ in rows], [t for _, t in rows]
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)

    def seconds(n: int) -> float:
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            return ys[-1] + slope * (n - xs[-1])
        i = bisect.bisect_left(xs, n)
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (n - xs[i - 1]) / (xs[i] - xs[i - 1])
    return seconds


def plan(alphas: Sequence[float], caps: Sequence[int], step_seconds, base_tokens: int | None = None,
         draft_seconds=None, max_tokens: int | None = None, min_speedup: float = 1.0) -> list[int]:
    """Proposals per request maximising the step's expected useful tokens (prompt tokens computed plus tokens
    emitted) per second of step time.

    `alphas[i]`: request i's acceptance rate; `caps[i]`: the most it may propose. `step_seconds(n)`: the
    target's step of n tokens; `base_tokens`: the tokens the step carries without proposals (default: one per
    request; prompt chunks in the same step add to it); `draft_seconds(n)`: one draft pass over n requests
    (None: proposals cost nothing, as n-gram lookups). `max_tokens` caps the step (the token budget). All zeros
    unless the best plan beats not speculating by `min_speedup`.

    The j-th proposal of request i adds alpha_i^j expected tokens, falling in j, so for every total M of
    proposals the best split takes the M largest gains: scanning M = 0, 1, ... finds the optimum whenever the
    cost depends on M alone (no draft model); with a draft model the draft passes (pass j runs over the requests
    proposing at least j) are added along the same scan.
    """
    if len(alphas) != len(caps):
        raise ValueError(f"one cap per request: {len(alphas)} acceptance rates, {len(caps)} caps")
    num_seqs = len(alphas)
    base = num_seqs if base_tokens is None else base_tokens
    ks = [0] * num_seqs
    if not num_seqs:
        return ks
    gains = sorted(((a ** j, i) for i, (a, cap) in enumerate(zip(alphas, caps)) for j in range(1, cap + 1)),
                   key=lambda g: -g[0])
    if max_tokens is not None:
        gains = gains[:max(max_tokens - base, 0)]
    tokens = float(base)  # the step's work: its prompt tokens and the decodes' emitted tokens
    best_rate = none_rate = tokens / step_seconds(base)
    best_m = 0
    passes: list[int] = []  # passes[j - 1]: requests proposing at least j tokens so far
    draft = 0.0
    taken = [0] * num_seqs
    for m, (gain, i) in enumerate(gains, start=1):
        taken[i] += 1
        tokens += gain
        if draft_seconds is not None:
            j = taken[i]
            if j > len(passes):
                passes.append(0)
            before = passes[j - 1]
            passes[j - 1] += 1
            draft += draft_seconds(before + 1) - (draft_seconds(before) if before else 0.0)
        rate = tokens / (step_seconds(base + m) + draft)
        if rate > best_rate:
            best_rate, best_m = rate, m
    if best_rate < min_speedup * none_rate:
        return ks
    for _, i in gains[:best_m]:
        ks[i] += 1
    return ks


@dataclass
class _Acceptance:
    """Verified proposals as Bernoulli trials: each proposal up to and including the first rejection."""

    accepted: float = 0.0
    trials: float = 0.0

    def add(self, num_proposed: int, num_accepted: int, decay: float = 1.0) -> None:
        self.accepted = self.accepted * decay + num_accepted
        self.trials = self.trials * decay + num_accepted + (1 if num_accepted < num_proposed else 0)


@dataclass
class TunerConfig:
    """Knobs of the tuner; the defaults are what `"auto"` runs with."""

    max_k: int = 8  # the most proposals per request and step
    prior_acceptance: float = 0.7  # the workload's rate before any verification (optimistic: it gets measured)
    prior_weight: float = 4.0  # trials the workload's rate counts for in a request's own estimate
    workload_decay: float = 0.995  # per verification: the workload rate follows a changing mix of requests
    min_speedup: float = 1.02  # speculate only when the model predicts at least this gain (noise margin)
    probe_interval: int = 16  # a request held at k=0 by low acceptance proposes one token this often

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if not 0.0 <= self.prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {self.prior_acceptance}")
        if self.prior_weight <= 0 or not 0.0 < self.workload_decay <= 1.0 or self.min_speedup < 1.0:
            raise ValueError("prior_weight must be > 0, workload_decay in (0, 1] and min_speedup >= 1")
        if self.probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {self.probe_interval}")


@dataclass
class TunerStats:
    """What the tuner chose, for benchmarks and metrics: decisions by k."""

    chosen: dict[int, int] = field(default_factory=dict)

    def mean_k(self) -> float:
        n = sum(self.chosen.values())
        return sum(k * c for k, c in self.chosen.items()) / n if n else 0.0


class SpeculationTuner:
    """Chooses k per request each step from the measured step times and acceptance (see `plan`)."""

    def __init__(self, config: TunerConfig | None = None, step_times: StepTimes | None = None,
                 draft_times: StepTimes | None = None) -> None:
        self.config = config or TunerConfig()
        self.step_times = step_times if step_times is not None else StepTimes()
        self.draft_times = draft_times  # one draft pass by its requests; None: proposals cost nothing (n-gram)
        self.workload = _Acceptance()
        self._requests: dict[str, _Acceptance] = {}
        self._idle: dict[str, int] = {}  # request id -> steps held at k=0 by its acceptance
        self.stats = TunerStats()

    def observe_verification(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        if num_proposed <= 0:
            return
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"accepted {num_accepted} of {num_proposed} proposals")
        self._requests.setdefault(request_id, _Acceptance()).add(num_proposed, num_accepted)
        self.workload.add(num_proposed, num_accepted, self.config.workload_decay)

    def forget(self, request_id: str) -> None:
        """The request left the engine."""
        self._requests.pop(request_id, None)
        self._idle.pop(request_id, None)

    # ---- estimates -------------------------------------------------------------------------------
    def workload_acceptance(self) -> float:
        c, w = self.config, self.workload
        return (w.accepted + c.prior_weight * c.prior_acceptance) / (w.trials + c.prior_weight)

    def acceptance(self, request_id: str) -> float:
        """The request's own rate, shrunk toward the workload's while it has few verifications."""
        prior, weight = self.workload_acceptance(), self.config.prior_weight
        r = self._requests.get(request_id)
        return prior if r is None else (r.accepted + weight * prior) / (r.trials + weight)

    # ---- the choice ------------------------------------------------------------------------------
    def choose(self, request_ids: Sequence[str], caps: Sequence[int] | None = None, base_tokens: int | None = None,
               max_tokens: int | None = None) -> dict[str, int]:
        """k for each decoding request of the coming step: at most `caps[i]` (default max_k); `base_tokens`: the
        step's tokens without proposals (default one per request)."""
        if not request_ids:
            return {}
        c = self.config
        caps = [min(cap, c.max_k) for cap in caps] if caps is not None else [c.max_k] * len(request_ids)
        cost = step_seconds(self.step_times)
        if cost is None:  # nothing measured yet: time a step without proposals, then one with the most
            return self._count(dict(zip(request_ids, caps if self.step_times.seconds else [0] * len(caps))))
        draft = step_seconds(self.draft_times) if self.draft_times is not None else None
        if draft is None and self.draft_times is not None and self.draft_times.seconds:
            (_, once), = self.draft_times.seconds.items()
            draft = lambda n: once  # one measured pass: its time for any batch until a second size is seen
        alphas = [self.acceptance(rid) for rid in request_ids]
        ks = plan(alphas, caps, cost, base_tokens, draft, max_tokens, c.min_speedup)
        if not any(ks):
            return self._count(self._probes(request_ids, caps, cost, base_tokens, draft, max_tokens))
        for rid, k in zip(request_ids, ks):
            if k:
                self._idle.pop(rid, None)
        return self._count(dict(zip(request_ids, ks)))

    def _probes(self, request_ids, caps, cost, base_tokens, draft, max_tokens) -> dict[str, int]:
        """k=0 for all: a request that would speculate at full acceptance proposes one token every
        `probe_interval` steps, so a request whose text turns repetitive is noticed."""
        ks = dict.fromkeys(request_ids, 0)
        if not any(plan([1.0] * len(request_ids), caps, cost, base_tokens, draft, max_tokens,
                        self.config.min_speedup)):
            return ks  # the batch alone rules speculation out
        for rid, cap in zip(request_ids, caps):
            idle = self._idle.get(rid, 0) + 1
            self._idle[rid] = idle
            if idle >= self.config.probe_interval and cap:
                ks[rid] = 1
                self._idle[rid] = 0
        return ks

    def _count(self, ks: dict[str, int]) -> dict[str, int]:
        chosen = self.stats.chosen
        for k in ks.values():
            chosen[k] = chosen.get(k, 0) + 1
        return ks


class TunedLength:
    """`num_speculative_tokens: "auto"`: the speculator's length policy, one plan for the step's decodes.

    Reads the speculator's own measurements from the queries: its step times and each request's verification
    record, whose growth since the request's last query is that verification's outcome."""

    def __init__(self, config: TunerConfig | None = None) -> None:
        # draft passes are timed only where a draft model proposes (observe_draft); n-gram lookups leave it empty
        self.tuner = SpeculationTuner(config, draft_times=StepTimes())
        self._seen: dict[str, tuple[int, int, int]] = {}  # request id -> (drafts, draft tokens, accepted) read

    @property
    def max_tokens(self) -> int:
        return self.tuner.config.max_k

    def choose(self, query: LengthQuery) -> int:
        return self.choose_all([query])[0]

    def choose_all(self, queries: Sequence[LengthQuery]) -> list[int]:
        """k per query, planned together (they share the step)."""
        if not queries:
            return []
        tuner = self.tuner
        tuner.step_times = queries[0].step_times
        for q in queries:
            a = q.acceptance
            now = (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens)
            drafts, proposed, accepted = (x - y for x, y in zip(now, self._seen.get(q.request_id, (0, 0, 0))))
            if drafts:
                # one verification per step: accepted proposals, then a rejection unless all were accepted
                tuner.observe_verification(q.request_id, proposed, accepted)
            self._seen[q.request_id] = now
        ks = tuner.choose([q.request_id for q in queries], [q.max_tokens for q in queries])
        return [ks[q.request_id] for q in queries]

    def observe_draft(self, num_seqs: int, num_passes: int, seconds: float) -> None:
        """The draft model proposed up to `num_passes` tokens for `num_seqs` requests in `seconds`."""
        if num_passes > 0 and seconds > 0:
            self.tuner.draft_times.add(num_seqs, seconds / num_passes)

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._seen.pop(rid, None)
            self.tuner.forget(rid)
