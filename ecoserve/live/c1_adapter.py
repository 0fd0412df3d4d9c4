"""TEMPORARY: the controller surface C1 (`topology()`, `summary()`, `scale_by_hand()`, `InstanceReported(id)`)
for controllers that do not offer it yet. The lead deletes this module at merge and calls the methods directly.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ecoserve.cluster import events as ev
from ecoserve.cluster.status import InstanceStatus
from ecoserve.cluster.topology import Topology


def topology(controller: Any) -> Topology:
    if hasattr(controller, "topology"):
        return controller.topology()
    setups = getattr(controller, "setups", {})
    roles = {iid: s.role for iid, s in setups.items()}
    macros = {mid: tuple(mac.instances) for mid, mac in getattr(controller, "macros", {}).items()}
    mitosis = getattr(controller, "mitosis", None)
    if mitosis is not None:
        return Topology(roles, macros, tuple(mitosis.free), tuple(sorted(mitosis.draining)))
    members = {i for ids in macros.values() for i in ids}
    free = tuple(i for i in setups if i not in members) if macros else ()
    return Topology(roles, macros, free)


def summary(controller: Any) -> dict[str, Any]:
    if hasattr(controller, "summary"):
        return controller.summary()
    return {"num_dispatched": dict(getattr(controller, "num_dispatched", {}))}


def scale_by_hand(controller: Any, macro: int, delta: int) -> list[ev.Action]:
    if hasattr(controller, "scale_by_hand"):
        return controller.scale_by_hand(macro, delta)
    from ecoserve.cluster.manual import scale_by_hand as by_hand
    return by_hand(controller, macro, delta)


def reported(instance_id: int, status_of: Callable[[int], InstanceStatus]) -> ev.Event:
    if "instance_id" in {f.name for f in dataclasses.fields(ev.InstanceReported)}:
        return ev.InstanceReported(instance_id)
    return ev.InstanceReported(status_of(instance_id))
