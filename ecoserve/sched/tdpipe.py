"""TD-Pipe (ICPP'25): temporally disaggregated pipeline scheduling, as in the authors' scheduler.

Requests go waiting -> in flight -> ready. The instance alternates long phases:

- *prefill*: admit waiting prompts FCFS into small micro-batches (until n_seqs * max_len reaches
  `peak_batch_size` padded tokens) while the KV use simulated over predicted output lengths stays
  under `prefill_kv_fraction` of the blocks (`kv_usage`, horizons 5 ... 4096 tokens);
- *decode*: micro-batches drawn FCFS from the ready requests, sized by inter-batch work stealing
  (`microbatch_size`), so the pp batches in flight stay near equal as requests finish.

Every pp decode micro-batches the decode->prefill switch compares the decode batch's intensity
with the prefill phase's intensity net of the switch bubble (`decode_to_prefill`), both from the
instance's tokens->time profile in truncated integer milliseconds, as the authors do. The
functions are pure so the hand-computed cases of the tests can check them one by one.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from ecoserve.request import RequestStatus
from ecoserve.sched.policy import Policy, register
from ecoserve.sched.predictors import OutputLengthPredictor, make_predictor
from ecoserve.sched.step import next_is_prefill

if TYPE_CHECKING:
    from ecoserve.request import Request
    from ecoserve.sched.scheduler import Scheduler
    from ecoserve.sched.step import StepBuilder

MIDPOINTS = (5, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
REFERENCE_BATCH = 256  # decode intensity is relative to the throughput of a 256-token forward pass
DEFAULT_PROFILE = Path(__file__).resolve().parent.parent / "sim" / "profiles" / "L20-Llama-13B.csv"


@dataclass(frozen=True)
class Profile:
    """A measured `tokens -> ms` table of one forward pass (TD-Pipe's `Total Length,Execute Time` CSV)."""

    ms: dict[int, float]

    @classmethod
    def from_csv(cls, path: str | Path) -> "Profile":
        with open(path, newline="") as f:
            rows = {int(r["Total Length"]): float(r["Execute Time"]) for r in csv.DictReader(f)}
        if REFERENCE_BATCH not in rows:
            raise ValueError(f"{path}: a TD-Pipe profile needs rows 1..{REFERENCE_BATCH} at least")
        return cls(rows)

    def time_ms(self, num_tokens: int) -> int:
        """Truncated milliseconds; past the table, linear from its last row (the authors' rule)."""
        last = max(self.ms)
        return int(self.ms.get(num_tokens, self.ms[last] * num_tokens / last))

    def intensity(self, batch_size: int, peak_batch_size: int = 192) -> float:
        """Decode throughput of `batch_size` relative to a 256-token pass; 1 from `peak_batch_size` on."""
        if batch_size >= peak_batch_size:
            return 1.0
        if batch_size <= 0:
            return 0.0
        return (batch_size / self.ms[batch_size]) / (REFERENCE_BATCH / self.ms[REFERENCE_BATCH])


def kv_usage(requests: Iterable[tuple[int, int]], block_size: int,
             midpoints: Sequence[int] = MIDPOINTS) -> dict[int, int]:
    """Blocks in use m tokens ahead, per horizon m, for (current length, predicted remaining output) pairs.

    A request predicted to finish before m has freed its blocks by then.
    """
    usage = dict.fromkeys(midpoints, 0)
    for cur_len, remaining in requests:
        for m in midpoints:
            if m <= remaining:
                usage[m] += math.ceil((cur_len + m) / block_size)
    return usage


def microbatch_size(num_requests: int, num_stages: int, decode_count: int) -> int:
    """Work stealing: floor(N / pp), plus one for the first N mod pp micro-batches of each round."""
    return num_requests // num_stages + (decode_count % num_stages < num_requests % num_stages)


@dataclass(frozen=True)
class SwitchDecision:
    decode_intensity: float
    prefill_intensity: float

    @property
    def switch(self) -> bool:
        return self.decode_intensity < self.prefill_intensity


def decode_to_prefill(running: Sequence[tuple[int, int]], waiting: Sequence[tuple[int, int]], total_blocks: int,
                      block_size: int, num_stages: int, profile: Profile,
                      peak_batch_size: int = 192) -> SwitchDecision | None:
    """Whether a prefill phase now beats continuing to decode; None when the decode batch is still saturated.

    running: (current length, predicted remaining) of requests in flight or ready; waiting: (prompt
    length, predicted output) in FCFS order. The prefill phase admits waiting requests while the
    simulated peak KV use stays under all blocks; it costs sum(T(len))/pp plus a fill/drain of
    max T/pp * (pp - 1), of which (max T/pp - T(decode batch)) * (pp - 1) is bubble.
    """
    batch = len(running) // num_stages
    if batch > peak_batch_size:
        return None
    decode_intensity = profile.intensity(batch, peak_batch_size)
    usage = kv_usage(running, block_size)
    prefill_time, longest, decode_batch = 0.0, 0, len(running)
    for length, predicted in waiting:
        if max(usage.values()) >= total_blocks:
            break
        for m, blocks in kv_usage([(length, predicted)], block_size).items():
            usage[m] += blocks
        t = profile.time_ms(length)
        prefill_time += t / num_stages
        longest = max(longest, t)
        decode_batch += 1
    prefill_time += longest / num_stages * (num_stages - 1)
    bubble = (longest / num_stages - profile.time_ms(decode_batch // num_stages)) * (num_stages - 1)
    prefill_intensity = (prefill_time - bubble) / prefill_time if prefill_time > 0 else 0.0
    return SwitchDecision(decode_intensity, prefill_intensity)


@register("tdpipe")
class TDPipe(Policy):
    """The policy over the one mechanism: phases, KV-horizon admission, intensity switch, work stealing."""

    def __init__(self) -> None:
        self.prefill_mode = True
        self.decode_count = 0
        self.profile: Profile | None = None
        self.predictor: OutputLengthPredictor | None = None
        self._predicted: dict[str, int] = {}
        self._last_batch: dict[str, int] = {}  # request id -> decode micro-batch it last ran in
        self._num_batches = 0

    def _setup(self, sched: "Scheduler") -> None:
        cfg = sched.config.tdpipe
        self.profile = Profile.from_csv(cfg.profile or DEFAULT_PROFILE)
        if isinstance(cfg.predictor, str):
            kwargs = {"noise": cfg.predictor_noise, "seed": 0} if cfg.predictor == "oracle" else \
                {"length": cfg.predictor_constant}
            self.predictor = make_predictor(cfg.predictor, **kwargs)
        else:
            self.predictor = cfg.predictor

    def predicted(self, req: "Request") -> int:
        rid = req.request_id
        if rid not in self._predicted:
            self._predicted[rid] = self.predictor.predict(req)
        return self._predicted[rid]

    def remaining(self, req: "Request") -> tuple[int, int]:
        """(current length, predicted remaining output) of a request."""
        return req.num_tokens, max(self.predicted(req) - req.num_output_tokens, 0)

    def schedule(self, sched: "Scheduler", step: "StepBuilder") -> None:
        if self.profile is None:
            self._setup(sched)
        for rid in [r for r in self._predicted if r not in sched.requests]:
            self._predicted.pop(rid)
            self._last_batch.pop(rid, None)
        stages = sched.config.tdpipe.num_stages or 1
        if not self.prefill_mode and not sched.running:
            self.prefill_mode = True  # nothing left to decode (the round of pp micro-batches ended early)
        elif self.decode_count % stages == 0:
            self.update_mode(sched, stages)
        if self.prefill_mode:
            if self._prefill(sched, step):
                self.decode_count = 0
                return
            self.prefill_mode = False
        if self._decode(sched, step, stages):
            self.decode_count += 1

    def update_mode(self, sched: "Scheduler", stages: int) -> None:
        cfg = sched.config.tdpipe
        if self.prefill_mode:
            peak = max(kv_usage((self.remaining(r) for r in sched.running), sched.kv.block_size).values())
            self.prefill_mode = bool(sched.waiting) and peak < cfg.prefill_kv_fraction * sched.kv.num_blocks
            return
        if not sched.waiting:
            return
        decision = decode_to_prefill([self.remaining(r) for r in sched.running],
                                     [(r.num_tokens, self.predicted(r)) for r in sched.waiting], sched.kv.num_blocks,
                                     sched.kv.block_size, stages, self.profile, cfg.peak_batch_size)
        if decision is not None and decision.switch:
            self.prefill_mode = True

    def _prefill(self, sched: "Scheduler", step: "StepBuilder") -> bool:
        """One prefill micro-batch: unfinished prompt chunks first, then whole waiting prompts FCFS."""
        for req in sched.running:  # the live list: a preemption below takes its victim out of the loop
            if next_is_prefill(req) and not step.full():
                sched.schedule_running(req, step)
        if step.chunks:
            return True
        peak = sched.config.tdpipe.peak_batch_size
        longest = 0
        while sched.waiting and not step.full():
            req = sched.next_waiting()
            if req is None:
                break
            if step.chunks and req.num_tokens - req.num_computed_tokens > step.token_budget:
                break
            if not sched.admit(req, step):
                break
            longest = max(longest, req.num_tokens)
            if len(step.chunks) * longest >= peak:
                break
        return bool(step.chunks)

    def _decode(self, sched: "Scheduler", step: "StepBuilder", stages: int) -> bool:
        """One decode micro-batch: the least recently run ready requests, sized by work stealing."""
        ready = [r for r in sched.running if sched.is_schedulable(r)]
        ready.sort(key=lambda r: self._last_batch.get(r.request_id, -1))  # stable: FCFS among equals
        target = microbatch_size(len(sched.running), stages, self.decode_count)
        taken = 0
        for i, req in enumerate(ready):
            if step.full():
                break
            if taken >= max(target, 1):
                left = len(ready) - i
                if left > stages:
                    break  # otherwise absorb the few left over rather than leave a tiny batch
            if req.status is RequestStatus.RUNNING and sched.schedule_running(req, step):  # not preempted meanwhile
                taken += 1
                self._last_batch[req.request_id] = self._num_batches
        self._num_batches += 1
        return taken > 0
