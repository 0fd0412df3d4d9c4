"""The authors' released macro-instance scheduler, as a router mode (`RouterConfig(mode="reference")`).

Written from a description of that scheduler, in our words: one prefill instance at a time (the
router's active window) and no router queue. A new request is checked against the prefill
instance only; if the check fails the next instance of the cycle becomes the prefill instance
and takes the request unconditionally. Times are whole milliseconds, predicted prefill times
come from the profile's anchors (`reference_ms`) and KV is counted in blocks of 16
(`reference_blocks`). The output hold is on by default.
"""
from __future__ import annotations

from ecoserve.cluster.events import Action, Dispatch
from ecoserve.cluster.modes import ROUTER_MODES, RouterMode
from ecoserve.cluster.profile import reference_blocks
from ecoserve.cluster.status import InstanceStatus

BLOCK = 16


def _max_slack_ms(st: InstanceStatus, origin_ms: float, tpot_ms: float) -> float | None:
    """Max over the decoding requests of first token + decode iterations x S_TPOT - origin (ms)."""
    best = None
    for q in st.requests:
        if q.first_token_time is not None:
            s = q.first_token_time * 1000 + max(q.num_output_tokens - 1, 0) * tpot_ms - origin_ms
            if best is None or s > best:
                best = s
    return best


@ROUTER_MODES.register("reference")
class ReferenceMode(RouterMode):
    holds_output = True

    def __init__(self) -> None:
        self.window_routed: dict[int, list[tuple[int, int]]] = {}  # instance -> (ms, blocks) routed in its window

    def opened(self, mac, instance_id, now):
        self.window_routed[instance_id] = []
        return []

    def check(self, mac, st: InstanceStatus, next_st: InstanceStatus | None, prompt_len: int,
              now: float) -> tuple[bool, str]:
        """Stay on the prefill instance `st` (True) or switch (False), with the deciding rule."""
        cfg = mac.config
        ttft_ms, tpot_ms = int(cfg.ttft_slo * 1000), int(cfg.tpot_slo * 1000)
        routed = self.window_routed.get(st.instance_id, [])
        need_time = mac.profile.reference_ms(prompt_len) + sum(ms for ms, _ in routed)
        need_blocks = reference_blocks(prompt_len) + sum(b for _, b in routed)
        if need_blocks > st.free_kv_tokens // BLOCK:
            return False, "memory"
        budgets = [ttft_ms for q in st.requests if q.first_token_time is None]  # the window's pending prefills
        slack = _max_slack_ms(st, int(mac.window_start.get(st.instance_id, now) * 1000), tpot_ms)
        if slack is not None:
            budgets.append(slack)
        if not budgets:
            return True, "empty"
        if min(budgets) > need_time:
            return True, "budget"
        if need_time > ttft_ms:
            return False, "ttft"
        if next_st is None:
            return False, "next_empty"
        nxt = _max_slack_ms(next_st, int(now * 1000), tpot_ms)
        if nxt is None:
            return False, "next_empty"
        n = len(mac.instances)
        return (True, "next_not_ready") if nxt < ttft_ms * (n - 1) / n else (False, "next_ready")

    def submit(self, mac, req, status_of, now) -> list[Action]:
        n = len(mac.instances)
        if n == 0:
            raise RuntimeError(f"macro instance {mac.macro_id} has no instance")
        acts: list[Action] = []
        if mac.active not in mac.instances:  # first request, or the prefill instance was moved away
            acts += mac.switch_to(mac.instances[mac.cursor % n], now)
        idx = mac.instances.index(mac.active)
        nxt = mac.instances[(idx + 1) % n] if n > 1 else None
        ok, _ = self.check(mac, status_of(mac.active), status_of(nxt) if nxt is not None else None,
                           req.prompt_len, now)
        if not ok and nxt is not None:
            mac.cursor = (idx + 1) % n
            acts += mac.switch_to(nxt, now)
        iid = mac.active
        self.window_routed[iid].append((mac.profile.reference_ms(req.prompt_len), reference_blocks(req.prompt_len)))
        acts.append(Dispatch(req.request_id, iid, req.max_tokens))
        return acts
