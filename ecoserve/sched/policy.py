"""The policy base class and the registry of policies by name (`SchedulerConfig.policy`).

Kept apart from the built-in policies so that a policy in its own module (TD-Pipe) and the
built-ins import the same base without importing each other.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the scheduler imports the policies; a policy only receives one
    from ecoserve.sched.scheduler import Scheduler
    from ecoserve.sched.step import StepBuilder

POLICIES: dict[str, type["Policy"]] = {}


def register(name: str) -> Callable[[type["Policy"]], type["Policy"]]:
    def wrap(cls: type[Policy]) -> type[Policy]:
        POLICIES[name] = cls
        cls.name = name
        return cls
    return wrap


class Policy:
    """Decides which requests get tokens this step, over the scheduler's one mechanism."""

    name = "base"

    def schedule(self, sched: "Scheduler", step: "StepBuilder") -> None:
        raise NotImplementedError
