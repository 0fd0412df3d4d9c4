"""APTMoE's affinity-aware placement, for serving: which routed experts run on the device, which run
where their weights live (the host), what stays resident, and in what order the rest are prefetched.

The host/device rule (APTMoE's solver): walk the non-resident routed experts from the fewest tokens up,
adding each one's host compute time to `comp` and its transfer time to `load` (which starts at the
layer's base load); while comp / load < 1 the host computes that expert hidden under the transfers,
and at the first expert where it does not, it and every hotter expert are loaded to the device.

Residency: each layer keeps at most `resident_budget` experts on the device, its most popular ones
(`ExpertPopularity`). An on-demand load stays resident when it finds a free slot or can evict the
least popular resident the step does not use; otherwise it passes through a transient buffer and is
dropped after the layer (with a budget of 0 every load is transient).

Prefetch: a three-level priority queue (`PrefetchQueue`): experts the running layer needs now (on
demand) > the next layer's predicted experts > the popular experts a layer lacks, most popular first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import IntEnum
from typing import Collection, Iterable, Mapping, Sequence

from ecoserve.moe.costs import CostTable
from ecoserve.moe.popularity import ExpertPopularity


def split_host_device(tokens: Mapping[int, int], costs: CostTable) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(host-computed, device-loaded) experts among `tokens` (expert -> routed tokens) by APTMoE's rule.

    Host experts come in walk order (fewest tokens first), device experts most tokens first; ties
    go by expert id.
    """
    coldest_first = sorted(tokens, key=lambda e: (tokens[e], e))
    comp, load = 0.0, costs.base_load_s
    host: list[int] = []
    for e in coldest_first:
        comp += costs.host_s(tokens[e])
        load += costs.load_s
        if comp / load >= 1.0:
            break
        host.append(e)
    device = [e for e in reversed(coldest_first) if e not in host]
    return tuple(host), tuple(device)


@dataclass(frozen=True)
class LayerPlan:
    """One layer's decisions for one step; every routed expert is in exactly one of hits, load, host."""

    layer: int
    hits: tuple[int, ...]  # routed and resident: computed on the device
    load: tuple[int, ...]  # routed, moved to the device now (on demand), then computed there
    host: tuple[int, ...]  # routed, computed where its weights live
    admit: tuple[int, ...]  # of `load`, those that stay resident (the rest are dropped after the layer)
    evict: tuple[int, ...]  # residents that give their slot to `admit`

    @property
    def device(self) -> tuple[int, ...]:
        return self.hits + self.load


class Priority(IntEnum):
    """Prefetch levels; a lower value is served first."""

    ON_DEMAND = 0
    NEXT_LAYER = 1
    POPULARITY = 2


class PrefetchQueue:
    """Transfers waiting for the link, served highest priority first and in arrival order within a level.

    An item pushed again at a higher priority moves up (keeping its place among that level's
    arrivals from then on); pushed at a lower one it stays where it is.
    """

    def __init__(self) -> None:
        self._levels: dict[Priority, OrderedDict[tuple[int, int], None]] = {p: OrderedDict() for p in Priority}
        self._level_of: dict[tuple[int, int], Priority] = {}

    def push(self, layer: int, expert: int, priority: Priority) -> None:
        key, priority = (layer, expert), Priority(priority)
        now = self._level_of.get(key)
        if now is not None and now <= priority:
            return
        if now is not None:
            del self._levels[now][key]
        self._levels[priority][key] = None
        self._level_of[key] = priority

    def pop(self) -> tuple[int, int, Priority] | None:
        """The next (layer, expert, priority), or None when empty."""
        for p in Priority:
            if self._levels[p]:
                (layer, expert), _ = self._levels[p].popitem(last=False)
                del self._level_of[(layer, expert)]
                return layer, expert, p
        return None

    def discard(self, layer: int, expert: int) -> None:
        p = self._level_of.pop((layer, expert), None)
        if p is not None:
            del self._levels[p][(layer, expert)]

    def drop_below(self, priority: Priority) -> None:
        """Forget every item of a lower priority than `priority` (their reason is stale)."""
        for p in Priority:
            if p > priority:
                for key in self._levels[p]:
                    del self._level_of[key]
                self._levels[p].clear()

    def __len__(self) -> int:
        return len(self._level_of)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._level_of

    def items(self) -> list[tuple[int, int, Priority]]:
        """Everything queued, in serving order."""
        return [(layer, e, p) for p in Priority for (layer, e) in self._levels[p]]


class PlacementPolicy:
    """Per layer and step: the plan for the routed experts, and what to prefetch for later layers."""

    def __init__(self, num_layers: int, num_experts: int, resident_budget: int, costs: CostTable,
                 popularity: ExpertPopularity | None = None) -> None:
        if not 0 <= resident_budget <= num_experts:
            raise ValueError(f"resident experts per layer must be in [0, {num_experts}], got {resident_budget}")
        self.num_layers, self.num_experts, self.resident_budget = num_layers, num_experts, resident_budget
        self.costs = costs
        self.popularity = popularity or ExpertPopularity(num_layers, num_experts)
        if (self.popularity.num_layers, self.popularity.num_experts) != (num_layers, num_experts):
            raise ValueError("the popularity tracker's layers and experts differ from the policy's")

    def resident_target(self, layer: int) -> tuple[int, ...]:
        """The experts a layer should keep on the device: its `resident_budget` most popular."""
        return tuple(self.popularity.ranked(layer)[:self.resident_budget])

    def plan_layer(self, layer: int, tokens_per_expert: Sequence[int], resident: Collection[int]) -> LayerPlan:
        if len(tokens_per_expert) != self.num_experts:
            raise ValueError(f"layer {layer}: {len(tokens_per_expert)} token counts for {self.num_experts} experts")
        if len(resident) > self.resident_budget:
            raise ValueError(f"layer {layer}: {len(resident)} resident experts exceed the budget {self.resident_budget}")
        routed = [e for e, n in enumerate(tokens_per_expert) if n > 0]
        hits = tuple(e for e in routed if e in resident)
        misses = {e: int(tokens_per_expert[e]) for e in routed if e not in resident}
        host, device = split_host_device(misses, self.costs)
        free = self.resident_budget - len(resident)
        used = set(routed)
        victims = [e for e in reversed(self.popularity.ranked(layer)) if e in resident and e not in used]
        admit, evict = [], []
        for e in device:  # hottest first: they keep the slots
            if free > 0:
                free -= 1
            elif victims:
                evict.append(victims.pop(0))
            else:
                break
            admit.append(e)
        return LayerPlan(layer, hits, device, host, tuple(admit), tuple(evict))

    def victim(self, layer: int, expert: int, resident: Collection[int], keep: Collection[int],
               priority: Priority) -> int | None:
        """A resident of `layer` a prefetch of `expert` may replace (least popular, not in `keep`), or None.

        A popularity prefetch replaces only a less popular expert; a predicted or on-demand one any.
        """
        scores = self.popularity.scores(layer)
        for e in reversed(self.popularity.ranked(layer)):
            if e in resident and e not in keep and e != expert:
                if priority == Priority.POPULARITY and scores[e] >= scores[expert]:
                    return None
                return e
        return None

    def enqueue_prefetch(self, queue: PrefetchQueue, next_layer: int | None, predicted: Iterable[int],
                         resident: Mapping[int, Collection[int]]) -> None:
        """Queue the next layer's predicted experts (priority 1) and every layer's missing popular experts
        (priority 2, most popular first, nearest layer first)."""
        if next_layer is not None:
            for e in predicted:
                if e not in resident[next_layer]:
                    queue.push(next_layer, e, Priority.NEXT_LAYER)
        order = range(self.num_layers) if next_layer is None else \
            [*range(next_layer, self.num_layers), *range(next_layer)]
        for layer in order:
            for e in self.resident_target(layer):
                if e not in resident[layer]:
                    queue.push(layer, e, Priority.POPULARITY)
