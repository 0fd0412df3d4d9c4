"""Mitosis scaling of macro instances (paper A7), as pure decisions over a topology.

The controller changes the `MacroTopology` its caller holds (macro id -> instance ids, a free
pool, draining instances) and returns the steps it took as `Scale` actions, which the caller
mirrors into its routers. Decisions the paper
leaves open, as taken here:
- Expand when a macro instance's tracked mean TTFT (the caller's window; the simulator includes
  the age of requests still waiting in the router) exceeds the TTFT SLO; one instance per action.
- Split when adding would exceed N_u: the new macro instance gets N_l instances (the added one and
  N_l - 1 moved from the original), so `n_upper >= 2 * n_lower - 1` keeps both within bounds.
- Contract when a macro instance's saved TPOT (the caller's aggregate: mean over its instances of
  the instance mean) exceeds `contract_factor * S_TTFT * (n+1)/n` (T_TTFT read as the TTFT SLO),
  and only while its mean TTFT is below `contract_below_ttft * S_TTFT`: the paper gives the two
  triggers no precedence, and under load the slack banked by long outputs stays above the range while
  TTFT sits just under its SLO, so without this margin a macro instance contracts right after it
  expanded and overloads again (measured: docs/reproduction.md, "Dynamic mitosis"); 1.0 disables it.
  The instance comes from the smallest macro instance above N_l, else from the largest, among the
  macro instances whose own mean TTFT is under that margin (a cold one never shrinks a hot one); one
  at N_l gives an instance only if it then merges with the smallest other (none stays below N_l); it
  drains (finishes its requests, receives nothing) and then returns to the free pool.
- Merge two macro instances whenever together they hold at most N_u (smallest two first).
- A macro instance with no TTFT evidence (the caller's `mean_ttft` lacks it: nothing it routed
  finished in the window and nothing waits in its router) neither expands nor contracts, however
  much TPOT slack its decoding requests banked: contracting needs a measured TTFT under the margin,
  so a macro instance that has just split off, or sits idle, cannot collapse a split.
- `cooldown_s` between actions on the same macro instance keeps one signal from firing twice.
Moving an instance moves only its handle: its requests stay on it, so no request is lost.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ecoserve.cluster.events import Scale
from ecoserve.cluster.topology import MacroTopology


@dataclass
class MitosisConfig:
    n_lower: int
    n_upper: int
    ttft_slo: float
    contract_factor: float = 1.0
    contract_below_ttft: float = 0.5  # contract only while mean TTFT < this x S_TTFT (1.0: no margin)
    cooldown_s: float = 10.0

    def __post_init__(self) -> None:
        if not 1 <= self.n_lower <= self.n_upper:
            raise ValueError(f"need 1 <= n_lower <= n_upper, got {self.n_lower}, {self.n_upper}")
        if self.n_upper < 2 * self.n_lower - 1:
            raise ValueError(f"n_upper must be >= 2*n_lower - 1 = {2 * self.n_lower - 1} so that a split "
                             f"leaves two macro instances of at least n_lower; got {self.n_upper}")


@dataclass
class MitosisController:
    config: MitosisConfig
    topology: MacroTopology  # the caller's: changed in place
    _last_action: dict[int, float] = field(default_factory=dict)
    _next_macro: int = 0

    def __post_init__(self) -> None:
        self._next_macro = max(self.topology.macros, default=-1) + 1

    @property
    def macros(self) -> dict[int, list[int]]:
        return self.topology.macros

    def _cooling(self, macro: int, now: float) -> bool:
        return now - self._last_action.get(macro, -1e18) < self.config.cooldown_s

    def step(self, now: float, mean_ttft: dict[int, float], saved_tpot: dict[int, float | None]) -> list[Scale]:
        """One control decision per macro instance; returns the actions applied to the topology.

        A macro instance missing from `mean_ttft` has no TTFT evidence and takes no action."""
        actions: list[Scale] = []
        margin = self.config.contract_below_ttft * self.config.ttft_slo
        cold = {m for m, v in mean_ttft.items() if v < margin}
        for m in sorted(self.macros):
            if m not in self.macros or self._cooling(m, now):
                continue
            n = len(self.macros[m])
            ttft = mean_ttft.get(m)
            if ttft is None:
                act = None  # no evidence: an idle macro instance is neither hot nor cold
            elif ttft > self.config.ttft_slo:
                act = self.expand(m)
            elif ttft >= margin:
                act = None  # between the triggers: keep the size
            else:
                saved = saved_tpot.get(m)
                limit = self.config.contract_factor * self.config.ttft_slo * (n + 1) / n
                act = self.contract(cold) if saved is not None and saved > limit else None
            if act:
                actions.extend(act)
                for a in act:
                    self._last_action[a.macro] = now
                    if a.other is not None:
                        self._last_action[a.other] = now
        return actions

    def expand(self, m: int) -> list[Scale]:
        if not self.topology.free:
            return []
        iid = self.topology.free.pop(0)
        members = self.macros[m]
        if len(members) < self.config.n_upper:
            members.append(iid)
            return [Scale("add", m, (iid,))]
        new = self._next_macro
        self._next_macro += 1
        k = self.config.n_lower - 1
        moved = tuple(members[len(members) - k:]) if k else ()
        del members[len(members) - k:]
        self.macros[new] = [*moved, iid]
        return [Scale("split", m, (iid, *moved), other=new)]

    def contract(self, donors: set[int] | None = None) -> list[Scale]:
        """Drain one instance from a donor (default: any macro instance), then merge what fits in N_u."""
        nl = self.config.n_lower
        pool = [m for m in self.macros if donors is None or m in donors]
        above = [m for m in pool if len(self.macros[m]) > nl]
        if above:
            m = min(above, key=lambda k: (len(self.macros[k]), k))
        else:
            if len(self.macros) <= 1 or not pool:
                return []
            m = max(pool, key=lambda k: (len(self.macros[k]), -k))
            smallest_other = min(len(v) for k, v in self.macros.items() if k != m)
            if len(self.macros[m]) <= 1 or len(self.macros[m]) - 1 + smallest_other > self.config.n_upper:
                return []  # it would stay below N_l: only drain at N_l when the merge follows
        return [self.drain(m)] + self.merge_small()

    def drain(self, m: int) -> Scale:
        """Take macro `m`'s newest instance out of routing; it is released once it holds no request."""
        iid = self.macros[m].pop()
        self.topology.draining.add(iid)
        return Scale("drain", m, (iid,))

    def merge_small(self) -> list[Scale]:
        acts = []
        while len(self.macros) > 1:
            a, b = sorted(self.macros, key=lambda k: (len(self.macros[k]), k))[:2]
            if len(self.macros[a]) + len(self.macros[b]) > self.config.n_upper:
                break
            keep, gone = (a, b) if len(self.macros[a]) >= len(self.macros[b]) else (b, a)
            self.macros[keep].extend(self.macros.pop(gone))
            acts.append(Scale("merge", keep, (), other=gone))
        return acts

    def release(self, instance_id: int) -> Scale:
        """A drained instance has no requests left: back to the free pool."""
        self.topology.draining.discard(instance_id)
        self.topology.free.append(instance_id)
        return Scale("release", -1, (instance_id,))

    def count(self) -> dict[str, int]:
        t = self.topology
        return {"active": sum(len(v) for v in t.macros.values()), "free": len(t.free),
                "draining": len(t.draining), "macros": len(t.macros)}
