"""The authors' released macro-instance scheduler (`RouterConfig(mode="reference")`).

Re-implemented from the description in shared/reference/ecoserve_authors_router.md, in our words:
one prefill instance at a time (the router's active window) and no router queue. A new request is
checked against the prefill instance only; if the check fails the next instance of the cycle
becomes the prefill instance and takes the request unconditionally. Times are whole
milliseconds, predicted prefill times come from the profile's anchors (`reference_ms`) and KV is
counted in blocks of 16 (`reference_blocks`). The output hold is on by default (router.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ecoserve.cluster.events import Action, Dispatch
from ecoserve.cluster.profile import reference_blocks
from ecoserve.cluster.status import InstanceStatus

if TYPE_CHECKING:
    from ecoserve.cluster.router import MacroInstance, PendingRequest, StatusOf

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


def reference_check(mac: "MacroInstance", st: InstanceStatus, next_st: InstanceStatus | None, prompt_len: int,
                    now: float) -> tuple[bool, str]:
    """Stay on the prefill instance `st` (True) or switch (False), with the deciding rule."""
    cfg = mac.config
    ttft_ms, tpot_ms = int(cfg.ttft_slo * 1000), int(cfg.tpot_slo * 1000)
    routed = mac.window_routed.get(st.instance_id, [])
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


def route_reference(mac: "MacroInstance", req: "PendingRequest", status_of: "StatusOf", now: float) -> list[Action]:
    n = len(mac.instances)
    if n == 0:
        raise RuntimeError(f"macro instance {mac.macro_id} has no instance")
    acts: list[Action] = []
    if mac.active not in mac.instances:  # first request, or the prefill instance was moved away
        acts += mac.switch_to(mac.instances[mac._last % n], now)
    idx = mac.instances.index(mac.active)
    nxt = mac.instances[(idx + 1) % n] if n > 1 else None
    ok, _ = reference_check(mac, status_of(mac.active), status_of(nxt) if nxt is not None else None,
                            req.prompt_len, now)
    if not ok and nxt is not None:
        mac._last = (idx + 1) % n
        acts += mac.switch_to(nxt, now)
    iid = mac.active
    mac.window_routed[iid].append((mac.profile.reference_ms(req.prompt_len), reference_blocks(req.prompt_len)))
    acts.append(Dispatch(req.request_id, iid, req.max_tokens))
    return acts
