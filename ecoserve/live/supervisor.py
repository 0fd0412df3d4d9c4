"""Replacing lost instances: the frontend restarts what it launched, in the same slot, with back-off.

A lost launched instance is killed and started again by its launcher after `restart_backoff_s`,
doubling with each restart of that slot (capped), at most `max_restarts` times. The slot keeps its
instance id: it is `starting` until the new process's `Ready` arrives, and only then does it rejoin
routing (the receiver posts `InstanceJoined` as at start). A slot that will not come back
(hand-started, restarts off or used up) stays on the board, lost with its reason, for
`lost_grace_s`, and then leaves it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from ecoserve.live.board import InstanceBoard, InstanceHandle
from ecoserve.live.launchers import Launcher
from ecoserve.live.shared import FrontendOptions

logger = logging.getLogger(__name__)

MAX_RESTART_BACKOFF_S = 30.0


def restart_backoff(base_s: float, restarts_so_far: int) -> float:
    """Seconds before the next restart of a slot restarted `restarts_so_far` times: base, doubling, capped."""
    return min(base_s * 2 ** restarts_so_far, max(MAX_RESTART_BACKOFF_S, base_s))


class Supervisor:
    """Owns the restart policy and the restarts in flight; the health watch tells it of every loss."""

    def __init__(self, board: InstanceBoard, planned: list[int], options: FrontendOptions,
                 launcher: Launcher | None, expect: Callable[[int, int], None]) -> None:
        self.board = board
        self.planned = planned  # the frontend's (and receiver's) planned slots: a slot that leaves, leaves it too
        self.opts = options
        self.launcher = launcher
        self.expect = expect  # (pid, instance id): the receiver matches the new process's `Ready` to its slot
        self.launched: set[int] = set()  # the slots the frontend started (only those are restarted)
        self.address: str | None = None  # where the instances connect
        self.restarts = 0  # restarts started, all slots together
        self.stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def started(self, address: str, launched: list[int]) -> None:
        self._loop = asyncio.get_running_loop()
        self.address = address
        self.launched.update(launched)

    def lost(self, h: InstanceHandle, now: float) -> None:
        """A slot was declared lost (its old process already killed): schedule its restart, or its removal."""
        h.lost_at = now
        if self.launcher is None or self.stopping or h.instance_id not in self.launched:
            return
        limit = self.opts.max_restarts
        if h.restarts >= limit:
            if limit > 0:
                h.lost_reason = f"{h.lost_reason} (not restarted: {h.restarts} restarts, the limit)"
                logger.error("instance %d stays lost: it was restarted %d times already", h.instance_id, h.restarts)
            return
        delay = restart_backoff(self.opts.restart_backoff_s, h.restarts)
        h.restart_pending = True
        logger.warning("restarting instance %d in %.1f s (restart %d of at most %d)", h.instance_id, delay,
                       h.restarts + 1, limit)
        self._loop.call_later(delay, self._relaunch, h)

    def _relaunch(self, h: InstanceHandle) -> None:
        if self.stopping or h.state != "lost" or self.board.instances.get(h.instance_id) is not h:
            h.restart_pending = False
            return
        future = self._loop.run_in_executor(None, self.launcher.relaunch, h.instance_id, self.address)
        future.add_done_callback(lambda f: self._relaunched(h, f))

    def _relaunched(self, h: InstanceHandle, future: asyncio.Future) -> None:
        try:
            pid = future.result()
        except Exception as e:  # the launcher could not start it: that restart counts, try again later
            logger.error("restarting instance %d failed: %r", h.instance_id, e)
            h.restarts += 1
            h.restart_pending = False
            h.lost_reason = f"restart failed: {e!r}"
            self.lost(h, time.monotonic())
            return
        if self.stopping:  # the frontend shut down while it started: it must not outlive the frontend
            h.restart_pending = False
            self.launcher.kill(h.instance_id)
            return
        self.restarts += 1
        h.restarted(pid, time.monotonic() + self.opts.ready_timeout_s)
        if pid is not None:
            self.expect(pid, h.instance_id)
        logger.info("instance %d restarted (pid %s); it rejoins once it reports ready", h.instance_id, pid)

    def sweep(self, now: float) -> None:
        """Lost slots that will not come back leave the board once their grace period is over."""
        for h in list(self.board.instances.values()):
            if h.state == "lost" and not h.restart_pending and h.lost_at is not None \
                    and now - h.lost_at >= self.opts.lost_grace_s:
                logger.info("instance %d leaves the board (lost %.0f s ago: %s)", h.instance_id, now - h.lost_at,
                            h.lost_reason)
                self.board.remove(h.instance_id)
                if h.instance_id in self.planned:
                    self.planned.remove(h.instance_id)
