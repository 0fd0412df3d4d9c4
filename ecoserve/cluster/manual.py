"""Mitosis by hand (`POST /cluster/scale`): one step on one macro instance, applied as a timer-driven one is."""
from __future__ import annotations

from ecoserve.cluster.events import Action


def scale_by_hand(controller, macro: int, delta: int) -> list[Action]:
    """+1: add a free instance to `macro` (split past N_u); -1: drain its newest instance. ValueError if impossible."""
    mitosis = getattr(controller, "mitosis", None)
    if mitosis is None:
        raise ValueError("this cluster has no mitosis: start it with --strategy ecoserve --mitosis N_L:N_U "
                         "--num-free-instances F")
    if macro not in mitosis.macros:
        raise ValueError(f"no macro instance {macro}; there are {sorted(mitosis.macros)}")
    if delta == 1:
        if not mitosis.free:
            raise ValueError("no free instance left to add")
        changes = mitosis.expand(macro)
    elif delta == -1:
        if len(mitosis.macros[macro]) <= 1:
            raise ValueError(f"macro instance {macro} has one instance; it cannot shrink")
        changes = [mitosis.drain(macro)]
    else:
        raise ValueError(f"delta must be +1 or -1, got {delta!r}")
    return controller.apply_changes(changes)
