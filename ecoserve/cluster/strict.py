"""Algorithm 1 as the paper prints it, as a router mode (`RouterConfig(mode="paper-strict")`).

Check (1) sums per-request predictions: the predicted prefill time of each request routed to the
instance since its window opened (the window start is the paper's `t_switch`), each prompt on
its own (`PrefillProfile.alone`), plus the new request's, must be <= S_TTFT. Check (2) compares
the decoding requests' slack with that sum; (3) memory and (4) seats are the router's. No timer
closes a window: it closes only when a check fails at the open instance and the cursor moves to
the next instance that passes. A request that passes nowhere waits in the router, FIFO, as the
paper says ("the request stays pending"); it is retried whenever the cluster changes.

The window's prefill phase ends when the instance has prefilled every prompt routed to it: it is
decoding again, so the next request routed there starts a new sum (the paper's next switch), even if
the cursor never moved (a macro instance of one instance has nowhere else to move it).

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

    def ttft_check(self, mac, st: InstanceStatus, prompt_len, now, queued_time):
        if st.instance_id == mac.active and not any(q.first_token_time is None for q in st.requests):
            self.window_predictions[st.instance_id] = []  # its prefill phase is over: a new one starts here
        routed = self.routed_since_switch(mac, st.instance_id)
        total = sum(routed) + mac.profile.alone(prompt_len)
        return total, total <= mac.config.ttft_slo or not routed
