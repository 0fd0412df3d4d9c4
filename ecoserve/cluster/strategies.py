"""The serving strategies by name: a controller for `vllm`, `sarathi`, `distserve`, `mooncake`, `ecoserve`.

`build_controller(name, options, clock, prefill_step_time)` is what both drivers call: the
simulator with its performance model's prefill time, the live frontend with a measured profile.

- vllm      NoDG, separate batching with prefill priority (`prefill_first`), round robin.
- sarathi   NoDG, decode-first hybrid batches with chunked prefill (`chunked`, `chunk_size` tokens).
- distserve FuDG intra-node: prefill and decode instances in a node, KV over the node's GPU link.
- mooncake  FuDG inter-node: KV over the node network.
- ecoserve  PaDG: `temporal` instances in macro instances, router-commanded windows, optional mitosis.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ecoserve.clock import Clock
from ecoserve.cluster.baselines import FuDGController, NoDGController
from ecoserve.cluster.controller import ControllerBase, StatusBoard
from ecoserve.cluster.mitosis import MitosisConfig
from ecoserve.cluster.padg import PaDGController
from ecoserve.cluster.profile import PrefillProfile
from ecoserve.cluster.router import RouterConfig
from ecoserve.cluster.status import InstanceStatus
from ecoserve.registry import Registry


@dataclass(frozen=True)
class ControllerOptions:
    """Everything a strategy may be told; each strategy reads the fields that concern it."""

    ttft_slo: float
    tpot_slo: float
    num_instances: int = 8
    max_num_batched_tokens: int = 4096  # separate batching (vLLM, EcoServe instance, FuDG prefill)
    chunk_size: int = 512  # Sarathi's token budget per hybrid step
    balance: str = "round_robin"  # NoDG: | "least_loaded"
    pd: tuple[int, int] | None = None  # FuDG P:D split (default half and half)
    kv_bytes_per_token: float = 0.0  # FuDG: KV bytes shipped per prompt token
    router_mode: str = "paper"  # ecoserve: paper | reference | fixed_interval
    router: dict = field(default_factory=dict)  # ecoserve: more RouterConfig fields (slack, order, output_hold ...)
    macro_sizes: tuple[int, ...] | None = None  # ecoserve: instances per macro instance (default: one of all)
    total_instances: int | None = None  # ecoserve with mitosis: instances including the free pool
    mitosis: dict | None = None  # ecoserve: MitosisConfig fields (n_lower, n_upper, ...); None: static
    mitosis_period: float = 5.0
    ttft_window: float = 30.0

    def router_config(self) -> RouterConfig:
        return RouterConfig(self.ttft_slo, self.tpot_slo, **{"mode": self.router_mode, **self.router})


Factory = Callable[[ControllerOptions, Clock, Callable[[int], float], StatusBoard], ControllerBase]
CONTROLLERS: Registry[Factory] = Registry("strategy")


def _split(o: ControllerOptions) -> tuple[int, int]:
    n_p, n_d = o.pd if o.pd else (o.num_instances // 2, o.num_instances - o.num_instances // 2)
    if n_p + n_d != o.num_instances:
        raise ValueError(f"P:D split {n_p}:{n_d} does not add up to {o.num_instances} instances")
    return n_p, n_d


@CONTROLLERS.register("vllm")
def _vllm(o, clock, step_time, board):
    return NoDGController(clock, board, list(range(o.num_instances)), "prefill_first", o.balance)


@CONTROLLERS.register("sarathi")
def _sarathi(o, clock, step_time, board):
    return NoDGController(clock, board, list(range(o.num_instances)), "chunked", o.balance, o.chunk_size)


@CONTROLLERS.register("distserve")
def _distserve(o, clock, step_time, board):
    return FuDGController(clock, board, *_split(o), o.kv_bytes_per_token, kv_path="intra_node")


@CONTROLLERS.register("mooncake")
def _mooncake(o, clock, step_time, board):
    return FuDGController(clock, board, *_split(o), o.kv_bytes_per_token, kv_path="inter_node")


@CONTROLLERS.register("ecoserve")
def _ecoserve(o, clock, step_time, board):
    mitosis = MitosisConfig(ttft_slo=o.ttft_slo, **o.mitosis) if o.mitosis is not None else None
    return PaDGController(clock, board, PrefillProfile(step_time, o.max_num_batched_tokens), o.router_config(),
                          list(o.macro_sizes or [o.num_instances]), o.total_instances, mitosis,
                          o.mitosis_period, o.ttft_window)


def build_controller(strategy: str, options: ControllerOptions, clock: Clock,
                     prefill_step_time: Callable[[int], float],
                     statuses: Callable[[int], InstanceStatus] | None = None) -> ControllerBase:
    """The named strategy's controller. `prefill_step_time(n)`: seconds of one prefill step of n tokens.

    `statuses`: read instance statuses on demand (the simulator); None: the controller keeps
    what `InstanceReported` and `InstanceJoined` bring (live).
    """
    return CONTROLLERS.get(strategy)(options, clock, prefill_step_time, StatusBoard(statuses, clock))
