"""What every cluster controller shares: where each request runs, lost instances, the driver surface.

Subclasses (NoDG, FuDG, PaDG) say where requests go, and what a lost instance and a (re)joined one
change in their routers. A controller reads time only from its
`Clock` and statuses only from the driver's status reader (`status_of`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ecoserve.clock import Clock
from ecoserve.cluster.events import (Action, Dispatch, Event, FinishRequest, InstanceJoined, InstanceLost,
                                     InstanceReported, InstanceSetup, PrefillDone, RequestAborted, RequestArrived,
                                     RequestFinished, TimerFired, TransferDone)
from ecoserve.cluster.status import StatusOf
from ecoserve.cluster.topology import Topology

NO_MITOSIS = "this cluster has no mitosis: start it with --strategy ecoserve --mitosis N_L:N_U --num-free-instances F"


class NoInstanceError(RuntimeError):
    """No instance can take the request now; the message says what is missing (it reaches the client)."""


class ControllerBase:
    """The `ClusterController` surface, written once; subclasses fill in the `on_*` hooks."""

    has_windows = False
    max_reroutes = 2  # a request whose instance is lost before its first token moves at most twice

    def __init__(self, clock: Clock, status_of: StatusOf, setups: dict[int, InstanceSetup]) -> None:
        self.clock = clock
        self.status_of = status_of
        self.setups = setups
        self.requests: dict[str, RequestArrived] = {}
        self.where: dict[str, int] = {}  # request id -> the instance it was last dispatched to
        self.num_dispatched: dict[int, int] = {i: 0 for i in setups}
        self._reroutes: dict[str, int] = {}
        self._handlers = {RequestArrived: self._arrived, InstanceReported: lambda e: self.on_step(e.instance_id),
                          InstanceJoined: self._joined, PrefillDone: self.on_prefill_done,
                          TransferDone: self.on_transfer_done, RequestFinished: self._finished,
                          RequestAborted: self._aborted, InstanceLost: self._lost, TimerFired: self.on_timer}

    # ---- the protocol ------------------------------------------------------------------------
    def start(self) -> list[Action]:
        return []

    def handle(self, event: Event) -> list[Action]:
        acts = self._handlers[type(event)](event)
        for a in acts:
            if type(a) is Dispatch:
                self.where[a.request_id] = a.instance_id
                self.num_dispatched[a.instance_id] = self.num_dispatched.get(a.instance_id, 0) + 1
        return acts

    def topology(self) -> Topology:
        return Topology({i: s.role for i, s in self.setups.items()})

    def summary(self) -> dict[str, Any]:
        return {"num_dispatched": dict(self.num_dispatched)}

    def scale_by_hand(self, macro: int, delta: int) -> list[Action]:
        raise ValueError(NO_MITOSIS)

    # ---- what subclasses say -------------------------------------------------------------------
    def on_arrival(self, req: RequestArrived) -> list[Action]:
        raise NotImplementedError

    def on_step(self, instance_id: int) -> list[Action]:
        return []

    def on_prefill_done(self, e: PrefillDone) -> list[Action]:
        raise ValueError(f"{type(self).__name__} has no prefill-only instances (got {e})")

    def on_transfer_done(self, e: TransferDone) -> list[Action]:
        raise ValueError(f"{type(self).__name__} ships no KV (got {e})")

    def on_finished(self, e: RequestFinished) -> list[Action]:
        return []

    def on_timer(self, e: TimerFired) -> list[Action]:
        return []

    def on_instance_lost(self, instance_id: int) -> None:
        """Stop routing to the instance (subclasses drop it from their routers)."""

    # ---- shared handling -----------------------------------------------------------------------
    def _arrived(self, e: RequestArrived) -> list[Action]:
        if e.request_id in self.requests:
            raise ValueError(f"request id {e.request_id!r} is already in the cluster")
        self.requests[e.request_id] = e
        return self.on_arrival(e)

    def on_instance_joined(self, instance_id: int) -> list[Action]:
        """An instance is up: a new one, or a lost one restarted in its slot (subclasses route to it again)."""
        return []

    def _joined(self, e: InstanceJoined) -> list[Action]:
        self.num_dispatched.setdefault(e.instance_id, 0)
        return self.on_instance_joined(e.instance_id)

    def _finished(self, e: RequestFinished) -> list[Action]:
        acts = self.on_finished(e)
        self.requests.pop(e.request_id, None)
        self.where.pop(e.request_id, None)
        self._reroutes.pop(e.request_id, None)
        return acts

    def _aborted(self, e: RequestAborted) -> list[Action]:
        self.requests.pop(e.request_id, None)
        self.where.pop(e.request_id, None)
        self._reroutes.pop(e.request_id, None)
        return []

    def _lost(self, e: InstanceLost) -> list[Action]:
        """Re-route the lost instance's requests that produced nothing yet, and those the driver resumes
        (as new arrivals of prompt + output so far); end the other started ones with an error."""
        iid = e.instance_id
        try:
            started = {q.request_id for q in self.status_of(iid).requests if q.first_token_time is not None}
        except KeyError:
            started = set()
        resume = {r.request_id: r for r in e.resume}
        self.on_instance_lost(iid)
        acts: list[Action] = []
        # a resumed request may have been dispatched elsewhere (FuDG: its KV was leaving the lost instance)
        for rid in [r for r, i in self.where.items() if i == iid or r in resume]:
            del self.where[rid]
            arrived = self.requests.get(rid)
            if arrived is not None and rid in resume:  # a migration: the driver counts and limits them
                r = resume[rid]
                arrived = self.requests[rid] = replace(arrived, prompt_len=r.prompt_len, max_tokens=r.max_tokens)
                acts += self.on_arrival(arrived)
                continue
            n = self._reroutes.get(rid, 0)
            if rid in started or n >= self.max_reroutes or arrived is None:
                self.requests.pop(rid, None)
                acts.append(FinishRequest(rid, f"instance {iid} was lost" + ("" if rid in started else
                                                                                f" ({n} re-routes)")))
                continue
            self._reroutes[rid] = n + 1
            acts += self.on_arrival(arrived)
        return acts
