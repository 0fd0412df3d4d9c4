"""The overall scheduler: assigns each request to a macro instance by load (paper A5).

Open decision (paper Part D.6), as taken here: the macro instance with the least outstanding work
per active instance, where outstanding work is the prompt tokens not yet prefilled, on its instances
(requests without a first token) and waiting in its router. Ties go to the lower mean KV use, then
the lower id. Work rather than router-queue length, because a router that never queues (reference
mode) would otherwise tie every macro instance at 0 and send everything to one of them.
"""
from __future__ import annotations

from dataclasses import dataclass

from ecoserve.cluster.controller import NoInstanceError
from ecoserve.cluster.router import MacroInstance
from ecoserve.cluster.status import InstanceStatus, StatusOf


@dataclass(frozen=True)
class InstanceLoad:
    unprefilled_tokens: int
    kv_used: float  # fraction of the KV cache in use or promised to queued prompts


def instance_load(st: InstanceStatus) -> InstanceLoad:
    tokens = sum(q.prompt_len for q in st.requests if q.first_token_time is None)
    used = 1.0 - st.free_kv_tokens / st.total_kv_tokens if st.total_kv_tokens > 0 else 0.0
    return InstanceLoad(tokens, used)


class OverallScheduler:
    def __init__(self, macros: dict[int, MacroInstance], status_of: StatusOf) -> None:
        self.macros = macros  # the caller's: mitosis changes it in place
        self.status_of = status_of
        self._loads: dict[int, tuple[InstanceStatus, InstanceLoad]] = {}  # per status object: pick runs per arrival

    def load_of(self, instance_id: int) -> InstanceLoad:
        st = self.status_of(instance_id)
        cached = self._loads.get(instance_id)
        if cached is not None and cached[0] is st:
            return cached[1]
        load = instance_load(st)
        self._loads[instance_id] = (st, load)
        return load

    def rank(self, mac: MacroInstance) -> tuple[float, float, int]:
        """(outstanding prompt tokens per instance, mean KV use, id): the lowest is picked."""
        loads = [self.load_of(i) for i in mac.instances]
        work = sum(x.unprefilled_tokens for x in loads) + sum(p.prompt_len for p in mac.pending)
        n = len(loads)
        return work / n, sum(x.kv_used for x in loads) / n, mac.macro_id

    def pick(self) -> MacroInstance:
        live = [m for m in self.macros.values() if m.instances]
        if not live:
            raise NoInstanceError("no instance is ready: no macro instance has an instance left "
                                  "(restarted ones rejoin once ready)")
        if len(live) == 1:
            return live[0]
        return min(live, key=self.rank)
