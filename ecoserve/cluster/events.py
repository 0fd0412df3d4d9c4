"""The contract between a cluster controller and its drivers: typed events in, typed actions out.

A controller (NoDG, FuDG, PaDG with mitosis) is pure policy: it reads time only from the `Clock`
it was built with, never touches sockets, tensors or the simulator, and answers each event with
the actions the driver must carry out. Two drivers run the same controllers: `ecoserve.sim`
(simulated instances on virtual time, a network model) and `ecoserve.live` (instance processes
over ZeroMQ on the wall clock). Instances are named by integer ids the driver assigns.

Messages are frozen dataclasses so that a driver can log, compare and replay them. Beyond events
and actions, a driver reads a controller only through `ClusterController`: what to start
(`setups`), who plays which part (`topology()`) and what it counted (`summary()`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, Union

from ecoserve.cluster.topology import Topology
from ecoserve.states import Role


# ---- events: driver -> controller -------------------------------------------------------------
@dataclass(frozen=True)
class RequestArrived:
    """A client request entered the cluster (the driver has tokenized it)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    arrival_time: float
    lora_name: str | None = None  # the LoRA adapter it runs with (routed by affinity); None: the base model


@dataclass(frozen=True)
class InstanceReported:
    """A fresh status of this instance can be read from the driver's status reader.

    The simulator sends it after each step of the instance, the live driver when a status arrives.
    """

    instance_id: int


@dataclass(frozen=True)
class InstanceJoined:
    """An instance is up and can take work (live: its `ready` message arrived)."""

    instance_id: int
    total_kv_tokens: int


@dataclass(frozen=True)
class PrefillDone:
    """FuDG: the prefill instance sampled the first token; the request's KV can be exported."""

    request_id: str
    instance_id: int
    num_tokens: int  # tokens whose KV exists on the prefill instance (the prompt)


@dataclass(frozen=True)
class TransferDone:
    """FuDG: a request's KV arrived at the decode instance."""

    request_id: str
    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class RequestFinished:
    """The request produced its last token (the driver counts tokens over FuDG's two legs)."""

    request_id: str
    instance_id: int
    ttft: float | None = None  # its TTFT as the client saw it (mitosis tracks the mean)


@dataclass(frozen=True)
class RequestAborted:
    """The client went away (or the request's deadline passed): forget it everywhere."""

    request_id: str


@dataclass(frozen=True)
class Resume:
    """A request that had produced output on a lost instance and moves on (a migrated stream): its
    input is now the prompt plus that output, and `max_tokens` counts what is still to come."""

    request_id: str
    prompt_len: int
    max_tokens: int


@dataclass(frozen=True)
class InstanceLost:
    """Process exit, missed heartbeat deadline or socket disconnect.

    `resume`: the started requests the driver moves on; any other started request of the instance ends.
    """

    instance_id: int
    resume: tuple[Resume, ...] = ()


@dataclass(frozen=True)
class TimerFired:
    name: str  # a timer the controller asked for with `SetTimer`


Event = Union[RequestArrived, InstanceReported, InstanceJoined, PrefillDone, TransferDone, RequestFinished,
              RequestAborted, InstanceLost, TimerFired]


# ---- actions: controller -> driver ------------------------------------------------------------
@dataclass(frozen=True)
class Dispatch:
    """Run the request on an instance, producing at most `max_tokens` output tokens.

    `imported_tokens` > 0: the request's first tokens' KV comes from a `TransferKV`; the instance
    must not compute them (FuDG decode side). Such a request continues after its first token:
    its input is the prompt plus that token, and `max_tokens` counts what is still to come.
    """

    request_id: str
    instance_id: int
    max_tokens: int
    imported_tokens: int = 0


STAGING = -1  # a `TransferKV.dst`: the decode side's staging buffer; a later `Dispatch` names the instance


@dataclass(frozen=True)
class TransferKV:
    """Ship a request's KV from `src` (over src's outgoing link) to `dst` or to `STAGING`."""

    request_id: str
    src: int
    dst: int
    num_tokens: int
    nbytes: int


@dataclass(frozen=True)
class OpenWindow:
    """The instance enters its prefill window (temporal policy: prompts may run)."""

    instance_id: int


@dataclass(frozen=True)
class CloseWindow:
    instance_id: int


@dataclass(frozen=True)
class HoldOutput:
    """Keep this instance's new tokens from clients until `ReleaseOutput` (reference mode)."""

    instance_id: int


@dataclass(frozen=True)
class ReleaseOutput:
    """Flush what was held for the instance, and stream its tokens again."""

    instance_id: int


ScaleKind = Literal["add", "split", "drain", "merge", "release"]


@dataclass(frozen=True)
class Scale:
    """A mitosis step applied to the topology (`macro` is -1 for a release: the instance joins the free pool)."""

    kind: ScaleKind
    macro: int
    instances: tuple[int, ...] = ()
    other: int | None = None  # the new macro (split) or the absorbed one (merge)


@dataclass(frozen=True)
class FinishRequest:
    """End a request the cluster cannot serve (e.g. re-routed too often): the driver reports `reason`."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class SetTimer:
    """Deliver `TimerFired(name)` at `time` (controller clock)."""

    name: str
    time: float


Action = Union[Dispatch, TransferKV, OpenWindow, CloseWindow, HoldOutput, ReleaseOutput, Scale, FinishRequest,
               SetTimer]


KVPath = Literal["intra_node", "inter_node"]


@dataclass(frozen=True)
class InstanceSetup:
    """What the driver must run on an instance: its role, scheduling policy and token budget."""

    role: Role
    policy: str  # a registered scheduling policy: prefill_first | chunked | temporal
    max_num_batched_tokens: int | None = None  # None: the driver's default
    kv_path: KVPath | None = None  # FuDG: the link its KV crosses (the node's GPU link or the node network)


class ClusterController(Protocol):
    """What every strategy's controller offers to both drivers; a driver reads nothing else of it.

    `setups` says what each instance id runs (the driver starts those instances);
    `has_windows` is True where instances run router-commanded windows (PaDG).
    """

    setups: dict[int, InstanceSetup]
    has_windows: bool

    def start(self) -> list[Action]:
        """Actions due before the first event (initial windows, timers)."""
        ...

    def handle(self, event: Event) -> list[Action]: ...

    def topology(self) -> Topology:
        """Roles, macro instances and their members, the free pool and the draining instances, as of now."""
        ...

    def summary(self) -> dict[str, Any]:
        """What the controller counted, JSON-able: always "num_dispatched" ({instance id: requests});
        FuDG adds "kv_path" and "kv_transferred_bytes", PaDG with mitosis "timeline" (one entry per step)."""
        ...

    def scale_by_hand(self, macro: int, delta: int) -> list[Action]:
        """A mitosis step by hand (+1: add a free instance to `macro`, -1: drain its newest one);
        ValueError where the strategy has no macro instances to scale or the step is impossible."""
        ...
