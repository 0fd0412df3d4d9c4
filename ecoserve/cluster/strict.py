"""Algorithm 1 as the paper prints it, as a router mode (`RouterConfig(mode="paper-strict")`).

Check (1) sums per-request predictions: the predicted prefill time of each request routed to the
instance since its window opened (the window start is the paper's `t_switch`), each prompt on
its own (`PrefillProfile.alone`), plus the new request's, must be <= S_TTFT. Check (2) compares
the decoding requests' slack with that sum; (3) memory and (4) seats are the router's. No timer
closes a window: it closes only when a check fails at the open instance and the cursor moves to
the next instance that passes. A request that passes nowhere waits in the router, FIFO, as the
paper says ("the request stays pending"); it is retried whenever the cluster changes.

When no instance passes and the open one has prefilled every prompt routed to it (it is decoding
again), its window starts anew (the paper's next switch) and the head is tried again: without that, a
macro instance of one instance, whose cursor has nowhere to move, would stall once a window's sum
reached S_TTFT. While another instance can take the request, the cursor moves on as printed.

One departure, so nothing waits forever: a request that would be alone in its window passes (1)
even if its own prediction exceeds S_TTFT (printed literally, such a prompt fits no instance).
"""
from __future__ import annotations

from ecoserve.cluster.modes import ROUTER_MODES, PaperMode
from ecoserve.cluster.status import InstanceStatus


@ROUTER_MODES.register("paper-strict")
class PaperStrictMode(PaperMode):
    def __init__(self) -> None:
        self.window_predictions: dict[int, list[float]] = {}  # instance -> predictions routed in its window

    def opened(self, mac, instance_id, now):
        self.window_predictions[instance_id] = []
        return []  # no close timer

    def routed(self, mac, instance_id, req):
        self.window_predictions.setdefault(instance_id, []).append(mac.profile.alone(req.prompt_len))

    def routed_since_switch(self, mac, instance_id: int) -> list[float]:
        """Predictions of the requests routed in `instance_id`'s open window; none if its window is closed
        (routing there opens a new window)."""
        return self.window_predictions.get(instance_id, []) if instance_id == mac.active else []

    def retry(self, mac, status_of, now):
        acts = super().retry(mac, status_of, now)
        active = mac.active
        if mac.pending and active is not None and self.window_predictions.get(active) \
                and not any(q.first_token_time is None for q in status_of(active).requests):
            self.window_predictions[active] = []  # its prefill phase is over: the next switch starts here
            acts += super().retry(mac, status_of, now)
        return acts

    def ttft_check(self, mac, st: InstanceStatus, prompt_len, now, queued_time):
        routed = self.routed_since_switch(mac, st.instance_id)
        total = sum(routed) + mac.profile.alone(prompt_len)
        return total, total <= mac.config.ttft_slo or not routed
