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


@dataclass
class MacroTopology:
    """PaDG's macro instances as it holds them: the one copy, which mitosis changes in place.

    Members are listed oldest first (mitosis drains and moves the newest); the routers keep only
    their rotation order over the members this says they have.
    """

    macros: dict[int, list[int]]
    free: list[int] = field(default_factory=list)
    draining: set[int] = field(default_factory=set)

    def macro_of(self, instance_id: int) -> int | None:
        return next((m for m, members in self.macros.items() if instance_id in members), None)

    def remove(self, instance_id: int) -> None:
        """A lost instance leaves its macro instance and the draining set."""
        for members in self.macros.values():
            if instance_id in members:
                members.remove(instance_id)
        self.draining.discard(instance_id)

    def freeze(self, roles: Mapping[int, Role]) -> Topology:
        return Topology(dict(roles), {m: tuple(v) for m, v in self.macros.items()}, tuple(self.free),
                        tuple(sorted(self.draining)))
