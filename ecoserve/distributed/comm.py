"""torch.distributed plumbing of one instance: process groups, the TP collectives and the PP stage links.

Gloo on CPU, NCCL on CUDA, picked from the device. Every collective and receive runs under the
process group's timeout, so a dead or stalled peer turns into an error instead of a hang.
"""
from __future__ import annotations

import socket
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Topology:
    """Global rank = stage * tp + tp_rank; the output rank (samples, replies) is TP rank 0 of the last stage."""

    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, tp_rank) of a global rank."""
        return divmod(rank, self.tp)

    @property
    def output_rank(self) -> int:
        return self.rank(self.pp - 1, 0)

    def describe(self, rank: int) -> str:
        stage, tp_rank = self.coords(rank)
        return f"rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"


class TPGroup:
    """The tensor-parallel collectives of one stage (implements ecoserve.model.parallel.TPComm)."""

    def __init__(self, ranks: list[int], rank: int, group) -> None:
        self.ranks, self.group = ranks, group
        self.size, self.rank = len(ranks), ranks.index(rank)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def gather_to_first(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in self.ranks] if self.rank == 0 else None
        dist.gather(t, parts, dst=self.ranks[0], group=self.group)
        return parts


class PipeLink:
    """Hidden states to the same TP rank of the next stage (async sends) and from the previous one."""

    MAX_PENDING_SENDS = 8  # sends may run ahead of the next stage by this many batches

    def __init__(self, prev_rank: int | None, next_rank: int | None, device: str = "cpu") -> None:
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, torch.device(device)
        self._pending: deque = deque()

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src=self.prev_rank)
        return buf

    def send(self, t: torch.Tensor) -> None:
        t = t.contiguous()
        self._pending.append((dist.isend(t, dst=self.next_rank), t))  # the tensor lives until the send is done
        while self._pending and (len(self._pending) > self.MAX_PENDING_SENDS or self._pending[0][0].is_completed()):
            self._pending.popleft()[0].wait()

    def flush(self) -> None:
        while self._pending:
            self._pending.popleft()[0].wait()


def init_distributed(topo: Topology, rank: int, port: int, device: str, timeout_s: float
                     ) -> tuple[TPGroup | None, PipeLink | None]:
    """Join the instance's process group; return this rank's TP group (None at tp=1) and stage link (None at pp=1)."""
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=topo.world_size, timeout=timedelta(seconds=timeout_s))
    stage, _ = topo.coords(rank)
    tp_group = None
    for s in range(topo.pp):  # every rank creates every group, in the same order
        ranks = [topo.rank(s, t) for t in range(topo.tp)]
        group = dist.new_group(ranks) if topo.tp > 1 else None
        if s == stage and group is not None:
            tp_group = TPGroup(ranks, rank, group)
    link = None
    if topo.pp > 1:
        link = PipeLink(rank - topo.tp if stage > 0 else None, rank + topo.tp if stage < topo.pp - 1 else None,
                        device)
    return tp_group, link
