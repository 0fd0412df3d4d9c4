"""The frontend's health watch: every 100 ms it pings, declares instances lost (process exit, missed
heartbeat, never joined) and ends requests past their deadline.

Silence is measured on the frontend's own schedule: when the watch wakes late (the event loop was
blocked), every instance gets that time back, and messages already queued on the socket are read
before anyone is judged, so a slow frontend never takes its instances for dead.
"""
from __future__ import annotations

import asyncio
import logging
import time
from ecoserve.cluster import events as ev
from ecoserve.live import messages as m
from ecoserve.live.board import InstanceHandle
from ecoserve.live.errors import InstanceLostError, RequestTimeoutError
from ecoserve.live.launchers import Launcher
from ecoserve.live.requests import LiveRequest
from ecoserve.live.shared import Frontend, FrontendOptions
from ecoserve.live.supervisor import Supervisor

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.1
LATE_S = 0.2  # a wake-up later than this past its period gives every instance the lost time back


class HealthWatch:
    """Owns the deadlines of instances (heartbeats, joining) and of requests, and how instances are lost."""

    def __init__(self, fe: Frontend, options: FrontendOptions, launcher: Launcher | None,
                 supervisor: Supervisor) -> None:
        self.fe = fe
        self.opts = options
        self.launcher = launcher  # a process exit it reports is a loss
        self.supervisor = supervisor  # told of every loss: it restarts the slot or lets it go
        self.deaths = 0  # instances declared lost
        self.migration_failures = 0  # started requests of lost instances that could not move on
        self.time_given_back = 0.0  # seconds of late wake-ups credited to the instances

    def arm(self) -> None:
        """The instances were launched now: they must join within the ready timeout."""
        deadline = time.monotonic() + self.opts.ready_timeout_s
        for h in self.fe.board.instances.values():
            if h.state == "starting":
                h.join_deadline = deadline

    def give_back(self, late_s: float) -> None:
        """The watch slept `late_s` longer than it asked: nobody was listening then, so nobody was silent."""
        self.time_given_back += late_s
        for h in self.fe.board.instances.values():
            h.last_heard += late_s
            h.join_deadline += late_s

    async def run(self) -> None:
        last_ping = 0.0
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            now = time.monotonic()
            late, last_tick = now - last_tick - WATCH_PERIOD_S, now
            try:
                if late > LATE_S:
                    logger.log(logging.WARNING if late >= 1.0 else logging.DEBUG,
                               "the frontend's event loop was blocked for %.1f s", late)
                    self.give_back(late)
                self.fe.drain()  # what is queued was sent in time: it counts as heard
                now = time.monotonic()
                self.check_instances(now)
                self.supervisor.sweep(now)
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
            elif h.state == "starting" and now > h.join_deadline:
                self.lose(h, f"did not join within {self.opts.ready_timeout_s:.0f} s")
        self.fe.check_ready()

    def _release_elsewhere(self, req: LiveRequest) -> None:
        """A migrating request starts afresh: KV still held for it on a live instance (FuDG) is freed."""
        for other in self.fe.board.instances.values():
            if req.request_id in other.requests:
                other.requests.discard(req.request_id)
                if other.state != "lost":
                    self.fe.send(other, m.Abort([req.request_id]))

    def lose(self, h: InstanceHandle, reason: str) -> None:
        """Declare an instance lost: the controller re-routes its requests, the started ones as prompt + output
        so far (a migration), unless they cannot move on: those end with an error naming why."""
        logger.error("instance %d lost: %s", h.instance_id, reason)
        h.state, h.lost_reason = "lost", reason
        self.deaths += 1
        if self.launcher is not None:
            self.launcher.kill(h.instance_id)
        resume: list[ev.Resume] = []
        for rid in list(h.requests):
            h.requests.discard(rid)
            req = self.fe.requests.get(rid)
            if req is None:
                continue
            if not req.streamed and req.transfer is None:
                req.lost_from = h.instance_id  # the controller's re-route will count
                continue
            refusal = req.migration_refusal(self.opts.max_migrations, self.fe.max_model_len)
            if refusal is not None:
                self.migration_failures += 1
                self.fe.fail(req, InstanceLostError(f"the instance serving this request was lost ({reason}) and "
                                                    f"the stream cannot move on: {refusal}"))
                continue
            self._release_elsewhere(req)
            req.begin_migration(h.instance_id)
            resume.append(ev.Resume(rid, len(req.prompt_token_ids) + req.num_output_tokens,
                                    req.remaining_tokens(self.fe.max_model_len)))
        if h.ready is not None:
            self.fe.post(ev.InstanceLost(h.instance_id, tuple(resume)))
        self.supervisor.lost(h, time.monotonic())
