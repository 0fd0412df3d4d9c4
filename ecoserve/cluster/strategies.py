"""The serving strategies by name: `vllm`, `sarathi`, `distserve`, `mooncake`, `ecoserve`.

Each registered `Strategy` knows the instance set-ups its options call for (`setups_for`, no
controller built: the live driver launches those instances before their profile exists) and
builds its controller (`build_controller`): the simulator passes its performance model's
prefill time, the live frontend the profile its instances measured.

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
from ecoserve.cluster.baselines import FuDGController, NoDGController, fudg_setups, nodg_setups
from ecoserve.cluster.controller import ControllerBase
from ecoserve.cluster.events import ClusterController, InstanceSetup
from ecoserve.cluster.mitosis import MitosisConfig
from ecoserve.cluster.padg import PaDGController, padg_setups
from ecoserve.cluster.profile import PrefillProfile
from ecoserve.cluster.router import RouterConfig
from ecoserve.cluster.status import StatusOf
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
    router_mode: str = "paper"  # ecoserve: a registered router mode (paper | paper-strict | reference | fixed_interval)
    router: dict = field(default_factory=dict)  # ecoserve: more RouterConfig fields (slack, order, output_hold ...)
    macro_sizes: tuple[int, ...] | None = None  # ecoserve: instances per macro instance (default: one of all)
    total_instances: int | None = None  # ecoserve with mitosis: instances including the free pool
    mitosis: dict | None = None  # ecoserve: MitosisConfig fields (n_lower, n_upper, ...); None: static
    mitosis_period: float = 5.0
    ttft_window: float = 30.0

    def __post_init__(self) -> None:
        if "mode" in self.router:
            raise ValueError(f"give the router mode as router_mode, not in router (got router={self.router!r})")

    def router_config(self) -> RouterConfig:
        return RouterConfig(self.ttft_slo, self.tpot_slo, mode=self.router_mode, **self.router)


StepTime = Callable[[int], float]  # seconds of one prefill step of n tokens


@dataclass(frozen=True)
class Strategy:
    setups: Callable[[ControllerOptions], dict[int, InstanceSetup]]
    build: Callable[[ControllerOptions, Clock, StepTime, StatusOf], ControllerBase]


STRATEGIES: Registry[Strategy] = Registry("strategy")


def _split(o: ControllerOptions) -> tuple[int, int]:
    n_p, n_d = o.pd if o.pd else (o.num_instances // 2, o.num_instances - o.num_instances // 2)
    if n_p + n_d != o.num_instances:
        raise ValueError(f"P:D split {n_p}:{n_d} does not add up to {o.num_instances} instances")
    return n_p, n_d


def _padg_total(o: ControllerOptions) -> int:
    return o.total_instances or sum(o.macro_sizes or [o.num_instances])


STRATEGIES.add("vllm", Strategy(
    lambda o: nodg_setups(list(range(o.num_instances)), "prefill_first"),
    lambda o, clock, step_time, status_of: NoDGController(clock, status_of, list(range(o.num_instances)),
                                                          "prefill_first", o.balance)))
STRATEGIES.add("sarathi", Strategy(
    lambda o: nodg_setups(list(range(o.num_instances)), "chunked", o.chunk_size),
    lambda o, clock, step_time, status_of: NoDGController(clock, status_of, list(range(o.num_instances)),
                                                          "chunked", o.balance, o.chunk_size)))
STRATEGIES.add("distserve", Strategy(
    lambda o: fudg_setups(*_split(o), "intra_node"),
    lambda o, clock, step_time, status_of: FuDGController(clock, status_of, *_split(o), o.kv_bytes_per_token,
                                                          kv_path="intra_node")))
STRATEGIES.add("mooncake", Strategy(
    lambda o: fudg_setups(*_split(o), "inter_node"),
    lambda o, clock, step_time, status_of: FuDGController(clock, status_of, *_split(o), o.kv_bytes_per_token,
                                                          kv_path="inter_node")))


def _ecoserve(o: ControllerOptions, clock: Clock, step_time: StepTime, status_of: StatusOf) -> PaDGController:
    mitosis = MitosisConfig(ttft_slo=o.ttft_slo, **o.mitosis) if o.mitosis is not None else None
    return PaDGController(clock, status_of, PrefillProfile(step_time, o.max_num_batched_tokens), o.router_config(),
                          list(o.macro_sizes or [o.num_instances]), o.total_instances, mitosis,
                          o.mitosis_period, o.ttft_window)


STRATEGIES.add("ecoserve", Strategy(lambda o: padg_setups(_padg_total(o), o.max_num_batched_tokens), _ecoserve))


def setups_for(strategy: str, options: ControllerOptions) -> dict[int, InstanceSetup]:
    """What each planned instance of the named strategy runs, without building its controller."""
    return STRATEGIES.get(strategy).setups(options)


def build_controller(strategy: str, options: ControllerOptions, clock: Clock, prefill_step_time: StepTime,
                     statuses: StatusOf) -> ClusterController:
    """The named strategy's controller. `prefill_step_time(n)`: seconds of one prefill step of n tokens;
    `statuses(instance_id)`: the driver's freshest status of an instance."""
    return STRATEGIES.get(strategy).build(options, clock, prefill_step_time, statuses)
