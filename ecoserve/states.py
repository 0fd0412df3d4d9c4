"""The serving words, defined once: a step's phase, an instance's role in a strategy, a live instance's state.

`sched/`, `cluster/`, `sim/` and `live/` all use these; nothing else spells them out.
"""
from __future__ import annotations

from typing import Literal, get_args

Phase = Literal["idle", "prefill", "decode"]  # what an instance's last step did (idle: nothing to run)
Role = Literal["both", "prefill", "decode"]  # NoDG and PaDG instances do both; FuDG splits them
InstanceState = Literal["starting", "ready", "draining", "free", "lost"]  # a live instance, as /cluster shows it

PHASES: tuple[Phase, ...] = get_args(Phase)
ROLES: tuple[Role, ...] = get_args(Role)
INSTANCE_STATES: tuple[InstanceState, ...] = get_args(InstanceState)
