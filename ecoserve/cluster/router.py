"""EcoServe's macro-instance router: rolling activation over router-owned prefill windows (paper A6).

The router owns the windows: when its cursor moves to an instance it opens that instance's
window (`OpenWindow`; the window start is Algorithm 1's `t_switch`) and closes the previous one
(`CloseWindow`). Four ways to decide when the cursor moves:

- `mode="paper"` (default): our reading of Algorithm 1, not the algorithm as printed. Each
  request tries the instance that took the previous one, then the rest of the cycle; a request
  that fits nowhere waits in the router (FIFO, the head blocks). At instance I, for a request r:
  (1) TTFT: max(time the window has been open, time r waited in the router) + the predicted
      batched prefill of I's unprefilled prompts and r  <=  S_TTFT. The window's first request
      has waited since the window opened, so no window outlasts S_TTFT (a timer closes it
      then, and the cursor moves on to the next instance). A request that is late
      already (its wait alone breaks the SLO) drops its own waiting term, and an instance with
      no window open and nothing queued passes (1) for any prompt, so nothing waits forever.
  (2) TPOT: the mean lifetime slack tokens x S_TPOT - (now - first token) of I's decoding
      requests (routed before the window) covers that batched prefill (`slack` picks min/phase
      ablations). No decoding request: passes.
  (3) memory: prompt + 1 token of KV fits, keeping `kv_reserve_frac` of I's KV free.
  (4) seats: I has a free seat (`max_num_seqs` minus running and queued requests).
- `mode="paper-strict"`: Algorithm 1 as printed (strict.py): check (1) is the sum of the
  per-request predicted prefill times of the requests routed since the window opened plus r's
  <= S_TTFT, check (2) compares the slack with that sum, (3) and (4) as above; no window timer
  (a window closes when a check fails there and the cursor moves); requests wait FIFO as above.
- `mode="reference"`: the authors' released scheduler (`reference.py`): one prefill instance at
  a time, no router queue, integer milliseconds; a failed check switches unconditionally.
- `mode="fixed_interval"` (ablation, Figs. 15-16): every `interval_frac x S_TTFT` the cursor moves
  on and takes every pending request, subject only to memory.

Each mode is a `RouterMode` object registered by name (modes.py); the router calls it at the
moments a mode decides and keeps everything else.

Output hold (`output_hold`; default on in reference mode only): the instance whose window is
open holds its clients' tokens until the window closes or S_TTFT has passed since it opened.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from ecoserve.cluster import reference, strict  # noqa: F401  (register the "reference" and "paper-strict" modes)
from ecoserve.cluster.events import Action, CloseWindow, HoldOutput, OpenWindow, ReleaseOutput, SetTimer
from ecoserve.cluster.modes import ROUTER_MODES
from ecoserve.cluster.profile import PrefillProfile
from ecoserve.cluster.status import InstanceStatus, StatusOf


@dataclass(frozen=True)
class RouterConfig:
    ttft_slo: float
    tpot_slo: float
    mode: str = "paper"
    slack: str = "mean"  # "mean" (paper) | "min" (ablation: protect each request) | "phase" (since the window)
    order: str = "cyclic"  # "cyclic" (paper) | "random" (ablation)
    interval_frac: float = 0.5  # fixed-interval period as a fraction of the TTFT SLO
    kv_reserve_frac: float = 0.05
    output_hold: bool | None = None  # None: on in reference mode, off otherwise
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ROUTER_MODES:
            raise ValueError(f"router mode must be one of {', '.join(ROUTER_MODES.names())}, got {self.mode!r}")
        if self.slack not in ("mean", "min", "phase"):
            raise ValueError(f"slack must be 'mean', 'min' or 'phase', got {self.slack!r}")
        if self.order not in ("cyclic", "random"):
            raise ValueError(f"order must be 'cyclic' or 'random', got {self.order!r}")

    @property
    def holds_output(self) -> bool:
        return ROUTER_MODES.get(self.mode).holds_output if self.output_hold is None else self.output_hold


@dataclass(frozen=True)
class Check:
    ok: bool
    reason: str  # "ok" | "ttft" | "tpot" | "memory" | "seats"
    window_prefill_time: float
    saved_tpot: float | None


@dataclass(frozen=True)
class PendingRequest:
    request_id: str
    prompt_len: int
    max_tokens: int
    queued_time: float
    lora_name: str | None = None  # its LoRA adapter: an instance holding it is preferred


class MacroInstance:
    """A cycle of instances with one open window at a time; requests that fit nowhere wait here."""

    def __init__(self, instance_ids: list[int], profile: PrefillProfile, config: RouterConfig,
                 macro_id: int = 0) -> None:
        self.macro_id = macro_id
        self.instances: list[int] = list(instance_ids)
        self.profile = profile
        self.config = config
        self.mode = ROUTER_MODES.get(config.mode)()
        self.pending: deque[PendingRequest] = deque()
        self.active: int | None = None  # the instance whose window is open
        self.window_start: dict[int, float] = {}  # instance -> when the router last opened its window
        self.cursor = 0  # index in `instances` of the instance that took the previous request
        self._held: int | None = None
        self._num_opened = 0
        self._rng = random.Random(config.seed)
        self._agg: dict[int, tuple[InstanceStatus, float, tuple]] = {}

    # ---- windows ---------------------------------------------------------------------------
    def switch_to(self, iid: int, now: float) -> list[Action]:
        """Close the open window (flushing held output) and open `iid`'s."""
        if iid == self.active:
            return []
        acts = self._close_active()
        self.active = iid
        self.window_start[iid] = now
        self._num_opened += 1
        acts.append(OpenWindow(iid))
        acts += self.mode.opened(self, iid, now)
        if self.config.holds_output:
            self._held = iid
            acts += [HoldOutput(iid), SetTimer(self.window_timer("release", iid), now + self.config.ttft_slo)]
        return acts

    def _close_active(self) -> list[Action]:
        if self.active is None:
            return []
        acts: list[Action] = [CloseWindow(self.active)]
        if self._held == self.active:
            acts.append(ReleaseOutput(self.active))
            self._held = None
        self.active = None
        return acts

    def window_timer(self, kind: str, iid: int) -> str:
        """A timer name for the current window: "release" (output hold) or "close" (paper mode)."""
        return f"{kind}/{self.macro_id}/{iid}/{self._num_opened}"

    def on_timer(self, name: str) -> list[Action]:
        """S_TTFT since the window opened: stop holding its output; in paper mode, close it and move on."""
        if self._held is not None and name == self.window_timer("release", self._held):
            iid, self._held = self._held, None
            return [ReleaseOutput(iid)]
        if self.active is not None and name == self.window_timer("close", self.active):
            if self.active in self.instances and self.instances:
                self.cursor = (self.instances.index(self.active) + 1) % len(self.instances)
            return self._close_active()
        return []

    # ---- membership (mitosis) --------------------------------------------------------------
    def add_instance(self, instance_id: int) -> None:
        """Insert right after the current position so it joins the rolling cycle promptly."""
        if instance_id in self.instances:
            raise ValueError(f"instance {instance_id} is already in macro instance {self.macro_id}")
        self.instances.insert(self.cursor + 1 if self.instances else 0, instance_id)

    def remove_instance(self, instance_id: int) -> list[Action]:
        """Stop routing to it (it drains elsewhere); keep the cycle position stable."""
        i = self.instances.index(instance_id)
        self.instances.pop(i)
        if i <= self.cursor:
            self.cursor = max(self.cursor - 1, 0)
        self._agg.pop(instance_id, None)
        return self._close_active() if instance_id == self.active else []

    def close(self) -> list[Action]:
        """The macro instance is dissolved (merge): close its window."""
        return self._close_active()

    # ---- Algorithm 1 ---------------------------------------------------------------------------
    def _aggregates(self, st: InstanceStatus) -> tuple:
        start = self.window_start.get(st.instance_id, -1.0) if st.instance_id == self.active else float("inf")
        cached = self._agg.get(st.instance_id)
        if cached is not None and cached[0] is st and cached[1] == start:
            return cached[2]
        tpot = self.config.tpot_slo
        backlog, n, sum_tok, sum_ft, min_term, sum_phase_tok, sum_phase_start = 0, 0, 0, 0.0, float("inf"), 0, 0.0
        for q in st.requests:
            ft = q.first_token_time
            if ft is None:
                backlog += q.prompt_len  # runs before a new prompt (window or carried over)
            elif q.routed_time < start:
                n += 1
                sum_tok += q.num_output_tokens
                sum_ft += ft
                term = q.num_output_tokens * tpot + ft
                if term < min_term:
                    min_term = term
                sum_phase_tok += q.num_output_tokens - q.tokens_at_switch
                sum_phase_start += max(ft, st.t_switch)
        agg = (backlog, n, sum_tok, sum_ft, min_term, sum_phase_tok, sum_phase_start)
        self._agg[st.instance_id] = (st, start, agg)
        return agg

    def saved_tpot(self, st: InstanceStatus, now: float) -> float | None:
        """Check (2)'s slack of the instance's decoding requests (None: nothing decoding)."""
        _, n, sum_tok, sum_ft, min_term, sum_phase_tok, sum_phase_start = self._aggregates(st)
        if n == 0:
            return None
        if self.config.slack == "min":
            return min_term - now
        if self.config.slack == "phase":  # only slack banked since the window opened
            return self.config.tpot_slo * sum_phase_tok / n - now + sum_phase_start / n
        return self.config.tpot_slo * sum_tok / n - now + sum_ft / n

    def memory_ok(self, st: InstanceStatus, prompt_len: int) -> bool:
        return prompt_len + 1 <= st.free_kv_tokens - self.config.kv_reserve_frac * st.total_kv_tokens

    def batched_ttft(self, st: InstanceStatus, prompt_len: int, now: float,
                     queued_time: float | None = None) -> tuple[float, bool]:
        """Paper mode's check (1): (the window's batched prefill with the prompt, whether it fits S_TTFT)."""
        cfg = self.config
        backlog = self._aggregates(st)[0]
        window = self.profile.batched(backlog + prompt_len)
        open_for = now - self.window_start[st.instance_id] if st.instance_id == self.active else 0.0
        waited = now - queued_time if queued_time is not None else 0.0
        if waited + self.profile.batched(prompt_len) > cfg.ttft_slo:
            waited = 0.0  # already late: its TTFT is lost, so only the window's own budget counts
        late = max(open_for, waited) + window > cfg.ttft_slo
        return window, not late or (open_for == 0 and backlog == 0)  # nothing queued: takes any prompt

    def check(self, st: InstanceStatus, prompt_len: int, now: float, queued_time: float | None = None) -> Check:
        """Algorithm 1 at instance `st`: check (1) as the mode defines it, then (2) TPOT, (3) memory, (4) seats."""
        window, ttft_ok = self.mode.ttft_check(self, st, prompt_len, now, queued_time)
        if not ttft_ok:
            return Check(False, "ttft", window, None)
        saved = self.saved_tpot(st, now)
        if saved is not None and saved < window:
            return Check(False, "tpot", window, saved)
        if not self.memory_ok(st, prompt_len):
            return Check(False, "memory", window, saved)
        if st.free_seats < 1:
            return Check(False, "seats", window, saved)
        return Check(True, "ok", window, saved)

    # ---- rolling activation ----------------------------------------------------------------
    def candidate_order(self) -> list[int]:
        """Previous request's instance first, then the rest of the cycle (or a random order)."""
        n = len(self.instances)
        if n == 0:
            return []
        if self.config.order == "random":
            first = self.cursor % n
            rest = [i for i in range(n) if i != first]
            self._rng.shuffle(rest)
            return [first] + rest
        return [(self.cursor + k) % n for k in range(n)]

    def try_route(self, req: PendingRequest, status_of: StatusOf, now: float) -> int | None:
        """The first instance in candidate order that passes Algorithm 1's checks; for a LoRA request, the first
        passing one that holds its adapter when there is one, else one with a free adapter slot (the windows
        roll as they would)."""
        if req.lora_name is not None:
            return self._try_route_adapter(req, status_of, now)
        for idx in self.candidate_order():
            iid = self.instances[idx]
            if self.check(status_of(iid), req.prompt_len, now, req.queued_time).ok:
                self.cursor = idx
                return iid
        return None

    def _try_route_adapter(self, req: PendingRequest, status_of: StatusOf, now: float) -> int | None:
        passing = [idx for idx in self.candidate_order()
                   if self.check(status_of(self.instances[idx]), req.prompt_len, now, req.queued_time).ok]
        if not passing:
            return None
        holding = [idx for idx in passing if req.lora_name in status_of(self.instances[idx]).loras]
        with_slot = [idx for idx in passing if status_of(self.instances[idx]).free_lora_slots > 0]
        self.cursor = (holding or with_slot or passing)[0]
        return self.instances[self.cursor]

    def submit(self, request_id: str, prompt_len: int, max_tokens: int, status_of: StatusOf,
               now: float, lora_name: str | None = None) -> list[Action]:
        """Queue a request and return the actions for what can go now."""
        return self.mode.submit(self, PendingRequest(request_id, prompt_len, max_tokens, now, lora_name), status_of,
                                now)

    def retry(self, status_of: StatusOf, now: float) -> list[Action]:
        """Dispatch waiting requests that can go now (paper mode: FIFO until the head fits nowhere)."""
        return self.mode.retry(self, status_of, now)

    def tick(self, status_of: StatusOf, now: float) -> list[Action]:
        """The controller's periodic tick (modes with a `period`: fixed interval)."""
        return self.mode.tick(self, status_of, now)
