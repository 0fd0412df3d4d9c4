"""EcoServe's macro-instance router: Algorithm 1 with rolling activation (paper A6).

Decisions the paper leaves open, as taken here:
- Window: requests routed to an instance at or after its last prefill->decode switch (`t_switch`)
  form the current prefill window; the paper says "arrival", and we use arrival *at the instance*
  so that a request that waited in the router still counts in the window it joins.
- Check (2) with no decoding request (an idle instance) passes: there is no TPOT to protect.
  Decoding requests without a first token yet (e.g. preempted) carry no slack and are skipped.
- Check (3) needs the prompt plus one token of KV, and keeps `kv_reserve_frac` of the instance's
  KV free for the decoding requests' growth (the paper publishes no reserve).
- Pending requests are retried FIFO whenever an instance reports; the head blocks the queue
  (no overtaking), so a long prompt is not starved by short ones.
- Statuses must include the router's own dispatches (the simulator's are always fresh; a live
  provider overlays what it sent since the last report).
- Slack (check 2) is each decoding request's lifetime slack, tokens x S_TPOT - (now - first token),
  as the reference's Algorithm 1 writes it. `slack="phase"` is an experimental reading of the
  paper's prose ("estimated over short intervals, accumulated per instance at each switch"): only
  the slack banked since the instance's last prefill->decode switch counts (instances report each
  request's token count at that switch). See docs/reproduction.md, "Slack and P99".
- Fixed-interval routing (ablation, Figs. 15-16): every `interval` seconds, all pending requests
  go to the next instance of the cycle, subject only to the memory check.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ecoserve.cluster.status import InstanceStatus

StatusOf = Callable[[int], InstanceStatus]


@dataclass
class RouterConfig:
    ttft_slo: float
    tpot_slo: float
    slack: str = "mean"  # "mean" (paper) | "min" (ablation: protect each request) | "phase" (see saved_tpot)
    order: str = "cyclic"  # "cyclic" (paper) | "random" (ablation)
    mode: str = "algorithm1"  # "algorithm1" | "fixed_interval" (ablation)
    interval_frac: float = 0.5  # fixed-interval period as a fraction of the TTFT SLO
    kv_reserve_frac: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.slack not in ("mean", "min", "phase"):
            raise ValueError(f"slack must be 'mean', 'min' or 'phase', got {self.slack!r}")
        if self.order not in ("cyclic", "random"):
            raise ValueError(f"order must be 'cyclic' or 'random', got {self.order!r}")
        if self.mode not in ("algorithm1", "fixed_interval"):
            raise ValueError(f"mode must be 'algorithm1' or 'fixed_interval', got {self.mode!r}")


@dataclass(frozen=True)
class Check:
    ok: bool
    reason: str  # "ok" | "ttft" | "tpot" | "memory"
    window_prefill_time: float
    saved_tpot: float | None


@dataclass(frozen=True)
class PendingRequest:
    request_id: str
    prompt_len: int
    queued_time: float


class MacroInstance:
    """Routes requests over a cycle of instances; requests that fit nowhere wait here."""

    def __init__(self, instance_ids: list[int], predict_prefill: Callable[[int], float], config: RouterConfig,
                 macro_id: int = 0) -> None:
        self.macro_id = macro_id
        self.instances: list[int] = list(instance_ids)
        self.predict_prefill = predict_prefill
        self.config = config
        self.pending: deque[PendingRequest] = deque()
        self._last = 0  # index in `instances` of the instance that took the previous request
        self._rng = random.Random(config.seed)
        self._agg: dict[int, tuple[InstanceStatus, tuple]] = {}

    # ---- membership (mitosis) --------------------------------------------------------------
    def add_instance(self, instance_id: int) -> None:
        """Insert right after the current position so it joins the rolling cycle promptly."""
        if instance_id in self.instances:
            raise ValueError(f"instance {instance_id} is already in macro instance {self.macro_id}")
        self.instances.insert(self._last + 1 if self.instances else 0, instance_id)

    def remove_instance(self, instance_id: int) -> None:
        """Stop routing to it (it drains elsewhere); keep the cycle position stable."""
        i = self.instances.index(instance_id)
        self.instances.pop(i)
        if i <= self._last:
            self._last = max(self._last - 1, 0)
        self._agg.pop(instance_id, None)

    # ---- Algorithm 1 ----------------------------------------------------------------------
    def _aggregates(self, st: InstanceStatus) -> tuple:
        cached = self._agg.get(st.instance_id)
        if cached is not None and cached[0] is st:
            return cached[1]
        cfg, window, n, sum_tok, sum_ft, min_term = self.config, 0.0, 0, 0, 0.0, float("inf")
        sum_phase_tok, sum_phase_start = 0, 0.0
        for q in st.requests:
            if q.routed_time >= st.t_switch:
                window += self.predict_prefill(q.prompt_len)
            elif q.first_token_time is not None:
                n += 1
                sum_tok += q.num_output_tokens
                sum_ft += q.first_token_time
                min_term = min(min_term, q.num_output_tokens * cfg.tpot_slo + q.first_token_time)
                sum_phase_tok += q.num_output_tokens - q.tokens_at_switch
                sum_phase_start += max(q.first_token_time, st.t_switch)
        agg = (window, n, sum_tok, sum_ft, min_term, sum_phase_tok, sum_phase_start)
        self._agg[st.instance_id] = (st, agg)
        return agg

    def saved_tpot(self, st: InstanceStatus, now: float) -> float | None:
        _, n, sum_tok, sum_ft, min_term, sum_phase_tok, sum_phase_start = self._aggregates(st)
        if n == 0:
            return None
        if self.config.slack == "min":
            return min_term - now
        if self.config.slack == "phase":
            # Experimental reading of the paper's prose ("estimated over short intervals, accumulated
            # per instance at each switch"): only slack banked since the instance's last
            # prefill->decode switch counts, so old requests' lifetime slack cannot fund new windows.
            return self.config.tpot_slo * sum_phase_tok / n - now + sum_phase_start / n
        return self.config.tpot_slo * sum_tok / n - now + sum_ft / n  # mean of tokens*S_TPOT - (now - t_first)

    def memory_ok(self, st: InstanceStatus, prompt_len: int) -> bool:
        return prompt_len + 1 <= st.free_kv_tokens - self.config.kv_reserve_frac * st.total_kv_tokens

    def check(self, st: InstanceStatus, prompt_len: int, now: float) -> Check:
        window = self._aggregates(st)[0] + self.predict_prefill(prompt_len)
        if window > self.config.ttft_slo:
            return Check(False, "ttft", window, None)
        saved = self.saved_tpot(st, now)
        if saved is not None and saved < window:
            return Check(False, "tpot", window, saved)
        if not self.memory_ok(st, prompt_len):
            return Check(False, "memory", window, saved)
        return Check(True, "ok", window, saved)

    # ---- rolling activation ----------------------------------------------------------------
    def candidate_order(self) -> list[int]:
        """Previous request's instance first, then the rest of the cycle (or a random order)."""
        n = len(self.instances)
        if n == 0:
            return []
        if self.config.order == "random":
            first = self._last % n
            rest = [i for i in range(n) if i != first]
            self._rng.shuffle(rest)
            return [first] + rest
        return [(self._last + k) % n for k in range(n)]

    def try_route(self, prompt_len: int, status_of: StatusOf, now: float) -> int | None:
        for idx in self.candidate_order():
            iid = self.instances[idx]
            if self.check(status_of(iid), prompt_len, now).ok:
                self._last = idx
                return iid
        return None

    def submit(self, request_id: str, prompt_len: int, status_of: StatusOf, now: float) -> list[tuple[str, int]]:
        """Queue a request and dispatch what can go now: [(request_id, instance_id), ...]."""
        self.pending.append(PendingRequest(request_id, prompt_len, now))
        if self.config.mode == "fixed_interval":
            return []
        return self.retry(status_of, now)

    def retry(self, status_of: StatusOf, now: float) -> list[tuple[str, int]]:
        """Dispatch pending requests FIFO until the head fits nowhere."""
        out = []
        while self.pending and self.config.mode == "algorithm1":
            head = self.pending[0]
            iid = self.try_route(head.prompt_len, status_of, now)
            if iid is None:
                break
            self.pending.popleft()
            out.append((head.request_id, iid))
        return out

    def interval_tick(self, status_of: StatusOf, now: float) -> list[tuple[str, int]]:
        """Fixed-interval ablation: send every pending request to the next instance of the cycle."""
        if not self.instances:
            return []
        self._last = (self._last + 1) % len(self.instances)
        iid = self.instances[self._last]
        out, st = [], status_of(iid)
        free = st.free_kv_tokens - self.config.kv_reserve_frac * st.total_kv_tokens
        while self.pending and self.pending[0].prompt_len + 1 <= free:
            head = self.pending.popleft()
            free -= head.prompt_len + 1
            out.append((head.request_id, iid))
        return out

    @property
    def interval(self) -> float:
        return self.config.interval_frac * self.config.ttft_slo
