"""Router modes: how a macro instance decides when its cursor moves, one object per macro instance.

A mode is registered by name (`RouterConfig.mode`) and answers the router's four moments: a
request is submitted, something changed so that waiting requests may go (`retry`), a window
opened, and the controller's periodic tick (only modes with a `period`). The router keeps the
windows, the cycle and the checks of Algorithm 1; a mode only says which of them to use when.
`paper` and `fixed_interval` are here, `paper-strict` (Algorithm 1 as printed) in strict.py and
`reference` (the authors' released router) in reference.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ecoserve.cluster.events import Action, Dispatch, SetTimer
from ecoserve.cluster.status import InstanceStatus, StatusOf
from ecoserve.registry import Registry

if TYPE_CHECKING:  # the router builds its mode; a mode only receives the router
    from ecoserve.cluster.router import MacroInstance, PendingRequest, RouterConfig


class RouterMode:
    name = "base"
    holds_output = False  # the output hold's default (`RouterConfig.output_hold` None)

    @classmethod
    def period(cls, config: "RouterConfig") -> float | None:
        """Seconds between the controller's ticks of every macro instance; None: no tick."""
        return None

    def submit(self, mac: "MacroInstance", req: "PendingRequest", status_of: StatusOf, now: float) -> list[Action]:
        raise NotImplementedError

    def ttft_check(self, mac: "MacroInstance", st: InstanceStatus, prompt_len: int, now: float,
                   queued_time: float | None) -> tuple[float, bool]:
        """Check (1): the window's predicted prefill time with the new prompt (check (2) compares the
        slack with it), and whether it passes. Default: paper mode's batched window."""
        return mac.batched_ttft(st, prompt_len, now, queued_time)

    def retry(self, mac: "MacroInstance", status_of: StatusOf, now: float) -> list[Action]:
        return []

    def opened(self, mac: "MacroInstance", instance_id: int, now: float) -> list[Action]:
        """The router just opened `instance_id`'s window; the actions that come with it."""
        return []

    def tick(self, mac: "MacroInstance", status_of: StatusOf, now: float) -> list[Action]:
        return []


ROUTER_MODES: Registry[type[RouterMode]] = Registry("router mode")


@ROUTER_MODES.register("paper")
class PaperMode(RouterMode):
    """Algorithm 1 as we read it: requests wait in the router (FIFO) until an instance passes the checks."""

    def submit(self, mac, req, status_of, now):
        mac.pending.append(req)
        return self.retry(mac, status_of, now)

    def retry(self, mac, status_of, now):
        acts: list[Action] = []
        while mac.pending:
            head = mac.pending[0]
            iid = mac.try_route(head, status_of, now)
            if iid is None:
                break
            mac.pending.popleft()
            acts += mac.switch_to(iid, now)
            acts.append(Dispatch(head.request_id, iid, head.max_tokens))
            self.routed(mac, iid, head)
        return acts

    def routed(self, mac, instance_id: int, req) -> None:
        """`req` was just dispatched to `instance_id` (whose window is open); modes that count a window's
        requests hook here."""

    def opened(self, mac, instance_id, now):
        # check (1) admits nothing after S_TTFT: close the window on time
        return [SetTimer(mac.window_timer("close", instance_id), now + mac.config.ttft_slo)]


@ROUTER_MODES.register("fixed_interval")
class FixedIntervalMode(RouterMode):
    """Ablation (Figs. 15-16): every `interval_frac x S_TTFT` the next instance takes every waiting request
    that fits its memory."""

    @classmethod
    def period(cls, config):
        return config.interval_frac * config.ttft_slo

    def submit(self, mac, req, status_of, now):
        mac.pending.append(req)
        return []

    def tick(self, mac, status_of, now):
        if not mac.instances:
            return []
        mac.cursor = (mac.cursor + 1) % len(mac.instances)
        iid = mac.instances[mac.cursor]
        acts = mac.switch_to(iid, now)
        st = status_of(iid)
        free = st.free_kv_tokens - mac.config.kv_reserve_frac * st.total_kv_tokens
        while mac.pending and mac.pending[0].prompt_len + 1 <= free:
            head = mac.pending.popleft()
            free -= head.prompt_len + 1
            acts.append(Dispatch(head.request_id, iid, head.max_tokens))
        return acts
