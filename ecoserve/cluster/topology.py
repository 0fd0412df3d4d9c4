"""Which instance plays which part, as one value a controller hands to its driver.

The controller owns the topology (FuDG's roles, PaDG's macro instances, mitosis' free pool and
draining instances); drivers read it through `ClusterController.topology()` and keep no copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ecoserve.states import Role


@dataclass(frozen=True)
class Topology:
    roles: Mapping[int, Role]  # every instance the controller plans for -> its role
    macros: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # PaDG: macro id -> member instances
    free: tuple[int, ...] = ()  # mitosis: started, in no macro instance, routed nothing
    draining: tuple[int, ...] = ()  # mitosis: finishing their requests, routed nothing, then free

    def macro_of(self, instance_id: int) -> int | None:
        return next((m for m, members in self.macros.items() if instance_id in members), None)
