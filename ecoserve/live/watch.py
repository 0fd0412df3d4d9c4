"""The frontend's health watch: every 100 ms it pings, declares instances lost (process exit, missed
heartbeat, never joined) and ends requests past their deadline."""
from __future__ import annotations

import asyncio
import logging
import time
from ecoserve.cluster import events as ev
from ecoserve.live import messages as m
from ecoserve.live.board import InstanceHandle
from ecoserve.live.errors import InstanceLostError, RequestTimeoutError
from ecoserve.live.launchers import Launcher
from ecoserve.live.shared import Frontend, FrontendOptions

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.1


class HealthWatch:
    """Owns the deadlines of instances (heartbeats, joining) and of requests, and how instances are lost."""

    def __init__(self, fe: Frontend, options: FrontendOptions, launcher: Launcher | None) -> None:
        self.fe = fe
        self.opts = options
        self.launcher = launcher  # a process exit it reports is a loss
        self.ready_deadline = float("inf")  # launched instances must have joined by then
        self.deaths = 0  # instances declared lost

    def arm(self) -> None:
        """The instances were launched now: they must join within the ready timeout."""
        self.ready_deadline = time.monotonic() + self.opts.ready_timeout_s

    async def run(self) -> None:
        last_ping = 0.0
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            now = time.monotonic()
            try:
                self.check_instances(now)
                if now - last_ping >= self.opts.ping_interval_s:
                    last_ping = now
                    for h in self.fe.board.instances.values():
                        if h.identity is not None and h.state != "lost":
                            self.fe.send(h, m.Ping(now))
                for req in [r for r in self.fe.requests.values() if now > r.deadline]:
                    logger.warning("request %s passed its deadline", req.request_id)
                    self.fe.fail(req, RequestTimeoutError(
                        f"the request did not finish within {self.opts.request_timeout_s:.0f} s"))
            except Exception:
                logger.exception("the frontend watchdog failed")

    def silence_allowed(self, h: InstanceHandle) -> float:
        """The heartbeat timeout, plus twice the instance's longest step: it beats between steps only."""
        return self.opts.heartbeat_timeout_s + 2 * (h.ready.max_step_ms / 1000 if h.ready else 0.0)

    def check_instances(self, now: float) -> None:
        for h in list(self.fe.board.instances.values()):
            if h.state == "lost":
                continue
            code = self.launcher.exit_code(h.instance_id) if self.launcher is not None else None
            if code is not None:
                self.lose(h, f"process exited with code {code}")
            elif h.state != "starting" and now - h.last_heard > self.silence_allowed(h):
                self.lose(h, f"no heartbeat for {now - h.last_heard:.1f} s")
            elif h.state == "starting" and now > self.ready_deadline:
                self.lose(h, f"did not join within {self.opts.ready_timeout_s:.0f} s")
        self.fe.check_ready()

    def lose(self, h: InstanceHandle, reason: str) -> None:
        """Declare an instance lost: its streaming requests end with an error; the controller re-routes the rest."""
        logger.error("instance %d lost: %s", h.instance_id, reason)
        h.state, h.lost_reason = "lost", reason
        self.deaths += 1
        if self.launcher is not None:
            self.launcher.kill(h.instance_id)
        for rid in list(h.requests):
            h.requests.discard(rid)
            req = self.fe.requests.get(rid)
            if req is None:
                continue
            if req.streamed or req.transfer is not None:
                self.fe.fail(req, InstanceLostError(f"the instance serving this request was lost ({reason})"))
            else:
                req.lost_from = h.instance_id  # the controller's re-route will count
        if h.ready is not None:
            self.fe.post(ev.InstanceLost(h.instance_id))
