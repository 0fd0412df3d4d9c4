"""The baselines' routers and controllers: NoDG (replicas behind a load balancer), FuDG (prefill -> KV -> decode).

A FuDG cluster that has lost every instance of one role serves whole requests on the survivors (NoDG:
prefill and decode on one instance) until an instance of that role joins again.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ecoserve.clock import Clock
from ecoserve.cluster.controller import ControllerBase, NoInstanceError
from ecoserve.cluster.events import (STAGING, Action, Dispatch, InstanceSetup, KVPath, PrefillDone, RequestArrived,
                                     TransferDone, TransferKV)
from ecoserve.cluster.status import InstanceStatus, StatusOf, prefer_holders

FUDG_DECODE_BUDGET = 1 << 15  # a decode instance's token budget: decodes only, so as many as it seats


def _load(st: InstanceStatus) -> tuple[int, int]:
    return (st.num_requests, -st.free_kv_tokens)


@dataclass
class NoDGRouter:
    """Each request goes to one replica that prefills and decodes it (vLLM, Sarathi)."""

    instances: list[int]
    policy: str = "round_robin"  # | "least_loaded" (fewest requests, then most free KV)
    _next: int = 0

    def __post_init__(self) -> None:
        if self.policy not in ("round_robin", "least_loaded"):
            raise ValueError(f"policy must be 'round_robin' or 'least_loaded', got {self.policy!r}")

    def route(self, status_of: StatusOf, lora_name: str | None = None, prompt_len: int = 0) -> int:
        """The balancing policy's pick; a request for a LoRA adapter goes to the least loaded instance that holds
        it while one has room."""
        if not self.instances:
            raise NoInstanceError("no instance is ready: every instance was lost (restarted ones rejoin once ready)")
        if lora_name is not None:
            holders = prefer_holders(self.instances, lora_name, prompt_len, status_of)
            if len(holders) < len(self.instances):
                return min(holders, key=lambda i: (_load(status_of(i)), i))
        if self.policy == "round_robin":
            iid = self.instances[self._next % len(self.instances)]
            self._next += 1
            return iid
        return min(self.instances, key=lambda i: _load(status_of(i)))


@dataclass
class FuDGRouter:
    """Prefill on a prefill instance, ship the KV, decode on a decode instance (DistServe, MoonCake).

    Prefill instances are picked least-loaded (queued prompt tokens are what delay TTFT); decode
    instances by most free KV, since they hold nearly all of it (the paper's memory imbalance).
    """

    prefill: list[int]
    decode: list[int]

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError(f"FuDG needs at least one prefill and one decode instance, got "
                             f"{len(self.prefill)}P:{len(self.decode)}D")

    def route_prefill(self, status_of: StatusOf, lora_name: str | None = None, prompt_len: int = 0) -> int:
        """The prefill instance with the fewest queued prompt tokens, among those holding the request's adapter
        while one has room."""
        return min(prefer_holders(self.prefill, lora_name, prompt_len, status_of),
                   key=lambda i: (sum(q.prompt_len for q in status_of(i).requests), i))

    def route_decode(self, status_of: StatusOf, kv_tokens: int) -> int | None:
        """The decode instance with most free KV, or None if none has room for `kv_tokens`."""
        best = max(self.decode, key=lambda i: (status_of(i).free_kv_tokens, -i))
        return best if status_of(best).free_kv_tokens >= kv_tokens else None


def nodg_setups(instances: list[int], policy: str,
                max_num_batched_tokens: int | None = None) -> dict[int, InstanceSetup]:
    return {i: InstanceSetup("both", policy, max_num_batched_tokens) for i in instances}


def fudg_setups(num_prefill: int, num_decode: int, kv_path: KVPath,
                decode_budget: int = FUDG_DECODE_BUDGET) -> dict[int, InstanceSetup]:
    """Prefill instances 0..P-1, then decode instances; both ends of the KV path know which link it is."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"FuDG needs at least one prefill and one decode instance, got {num_prefill}P:{num_decode}D")
    if kv_path not in ("intra_node", "inter_node"):
        raise ValueError(f"kv_path must be 'intra_node' or 'inter_node', got {kv_path!r}")
    n = num_prefill + num_decode
    setups = {i: InstanceSetup("prefill", "prefill_first", kv_path=kv_path) for i in range(num_prefill)}
    setups.update({i: InstanceSetup("decode", "prefill_first", decode_budget, kv_path) for i in range(num_prefill, n)})
    return setups


class NoDGController(ControllerBase):
    """Replicas that prefill and decode their own requests (vLLM: prefill_first; Sarathi: chunked)."""

    def __init__(self, clock: Clock, status_of: StatusOf, instances: list[int], policy: str = "prefill_first",
                 balance: str = "round_robin", max_num_batched_tokens: int | None = None) -> None:
        super().__init__(clock, status_of, nodg_setups(instances, policy, max_num_batched_tokens))
        self.router = NoDGRouter(list(instances), balance)

    def on_arrival(self, req: RequestArrived) -> list[Action]:
        return [Dispatch(req.request_id, self.router.route(self.status_of, req.lora_name, req.prompt_len),
                         req.max_tokens)]

    def on_instance_joined(self, instance_id: int) -> list[Action]:
        if instance_id not in self.router.instances:
            self.router.instances.append(instance_id)
        return []

    def on_instance_lost(self, instance_id: int) -> None:
        if instance_id in self.router.instances:
            self.router.instances.remove(instance_id)


class FuDGController(ControllerBase):
    """Prefill instances produce the first token, the KV goes to the decode side, a decode instance goes on.

    The KV leaves over the prefill instance's link into the decode side's staging buffer
    (`STAGING`); the decode instance is chosen when the KV is there and one has room (FIFO, the
    head blocks). `kv_path` tells the driver which link carries it: "intra_node" (DistServe) or
    "inter_node" (MoonCake). With no prefill or no decode instance left, the survivors take whole
    requests (and the KV already staged is decoded where it is) until the role is filled again.
    """

    def __init__(self, clock: Clock, status_of: StatusOf, num_prefill: int, num_decode: int,
                 kv_bytes_per_token: float, kv_path: KVPath = "inter_node",
                 decode_budget: int = FUDG_DECODE_BUDGET) -> None:
        super().__init__(clock, status_of, fudg_setups(num_prefill, num_decode, kv_path, decode_budget))
        n = num_prefill + num_decode
        self.router = FuDGRouter(list(range(num_prefill)), list(range(num_prefill, n)))
        self.kv_bytes_per_token = kv_bytes_per_token
        self.kv_path = kv_path
        self.staged: deque[str] = deque()  # KV on the decode side, waiting for a decode instance
        self.transferred_bytes = 0.0

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "kv_path": self.kv_path, "kv_transferred_bytes": self.transferred_bytes}

    @property
    def disaggregated(self) -> bool:
        """Both roles have an instance: prefill -> KV -> decode; otherwise the survivors serve whole requests."""
        return bool(self.router.prefill) and bool(self.router.decode)

    def on_arrival(self, req: RequestArrived) -> list[Action]:
        if req.request_id in self.staged:  # a migrated request starts over: the KV it staged is gone
            self.staged.remove(req.request_id)
        if self.disaggregated:
            return [Dispatch(req.request_id, self.router.route_prefill(self.status_of, req.lora_name, req.prompt_len), 1)]
        return [Dispatch(req.request_id, self._survivor(), req.max_tokens)]

    def _survivor(self) -> int:
        """The least loaded instance left, whatever its role (fewest requests, then most free KV)."""
        left = self.router.prefill + self.router.decode
        if not left:
            n_p = sum(1 for s in self.setups.values() if s.role == "prefill")
            raise NoInstanceError(f"no instance is ready: the FuDG cluster lost all {n_p} prefill and "
                                  f"{len(self.setups) - n_p} decode instances (restarted ones rejoin once ready)")
        return min(left, key=lambda i: (_load(self.status_of(i)), i))

    def on_prefill_done(self, e: PrefillDone) -> list[Action]:
        nbytes = e.num_tokens * self.kv_bytes_per_token
        self.transferred_bytes += nbytes
        return [TransferKV(e.request_id, e.instance_id, STAGING, e.num_tokens, nbytes)]

    def on_transfer_done(self, e: TransferDone) -> list[Action]:
        self.staged.append(e.request_id)
        return self._place()

    def on_step(self, instance_id: int) -> list[Action]:
        if not self.staged or (self.router.decode and instance_id not in self.router.decode):
            return []
        return self._place()  # a decode instance may have room now; with none left, the holders decode

    def _place(self) -> list[Action]:
        acts: list[Action] = []
        while self.staged:
            req = self.requests.get(self.staged[0])
            if req is None:  # aborted meanwhile
                self.staged.popleft()
                continue
            if self.router.decode:
                iid = self.router.route_decode(self.status_of, req.prompt_len + req.max_tokens)
            else:  # no decode instance: the prefill instance that holds the KV decodes the request itself
                iid = self.where.get(req.request_id)
                if iid not in self.router.prefill:
                    self.staged.popleft()  # its KV was on a lost instance; the loss ends or moves the request
                    continue
            if iid is None:
                break
            self.staged.popleft()
            acts.append(Dispatch(req.request_id, iid, req.max_tokens - 1, imported_tokens=req.prompt_len))
        return acts

    def on_instance_lost(self, instance_id: int) -> None:
        for group in (self.router.prefill, self.router.decode):
            if instance_id in group:
                group.remove(instance_id)

    def on_instance_joined(self, instance_id: int) -> list[Action]:
        """Its planned role again (a restarted instance keeps its slot); staged KV may fit there now."""
        setup = self.setups.get(instance_id)
        group = {"prefill": self.router.prefill, "decode": self.router.decode}.get(setup.role if setup else None)
        if group is None or instance_id in group:
            return []
        group.append(instance_id)
        group.sort()
        return self._place() if self.staged else []
