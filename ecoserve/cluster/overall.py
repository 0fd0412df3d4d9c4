"""The overall scheduler: assigns each request to a macro instance by capability.

Open decision (paper Part D.6), as taken here: the macro instance with the fewest requests waiting
in its router per active instance; ties go to the larger macro instance, then the lower id.
"""
from __future__ import annotations

from ecoserve.cluster.controller import NoInstanceError
from ecoserve.cluster.router import MacroInstance


class OverallScheduler:
    def __init__(self, macros: dict[int, MacroInstance]) -> None:
        self.macros = macros

    def pick(self) -> MacroInstance:
        live = [m for m in self.macros.values() if m.instances]
        if not live:
            raise NoInstanceError("no instance is ready: no macro instance has an instance left "
                                  "(restarted ones rejoin once ready)")
        return min(live, key=lambda m: (len(m.pending) / len(m.instances), -len(m.instances), m.macro_id))
