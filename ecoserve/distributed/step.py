"""The step message that leaves the process: `StepInput`, built from a `SchedulerOutput` as deltas.

A worker learns a request once (`NewRequest`: prompt, sampling params); afterwards each step
carries, per scheduled chunk, only its token ids, its position, the block ids appended to its
table (or the whole table when it was replaced, e.g. after preemption) and whether it samples,
plus the ids that finished, and to the output rank the grammar masks of constrained rows.
`WorkerRequests` on the worker side turns that back into a
`SchedulerOutput` over mirror `Request`s, so the runner that executes it is the in-process one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ecoserve.request import Request
from ecoserve.sampling import SamplingParams
from ecoserve.sched.interface import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from ecoserve.engine.guided import GrammarMasks


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # its seed makes the output rank's generator
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class ChunkInput:
    request_id: str
    start: int
    token_ids: list[int]  # tokens [start, start + len) whose KV this step computes
    samples: bool
    new_blocks: list[int]  # appended to the request's block table
    replaces_table: bool = False  # new_blocks is the whole table (the old one was dropped)


@dataclass(frozen=True)
class StepInput:
    step_id: int
    new_requests: tuple[NewRequest, ...]
    chunks: tuple[ChunkInput, ...]
    finished_ids: tuple[str, ...]
    masks: GrammarMasks | None = None  # structured outputs: only the output rank, which samples, gets them

    @property
    def num_tokens(self) -> int:
        """Rows of the hidden-state buffers a later pipeline stage receives."""
        return sum(len(c.token_ids) for c in self.chunks)


class StepInputBuilder:
    """Driver side: remembers what the workers hold, so each step sends only what changed."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}
        self._tables: dict[str, list[int]] = {}
        self._next_id = 0

    def build(self, batch: SchedulerOutput) -> StepInput:
        for rid in batch.finished_ids:
            self._requests.pop(rid, None)
            self._tables.pop(rid, None)
        new, chunks = [], []
        for c in batch.chunks:
            req = c.request
            rid = req.request_id
            if self._requests.get(rid) is not req:  # first sight (or an id reused by a new request)
                self._requests[rid] = req
                self._tables[rid] = []
                new.append(NewRequest(rid, list(req.prompt_token_ids), req.sampling_params, req.eos_token_ids))
            sent, table = self._tables[rid], batch.block_tables[rid]
            keeps = len(sent) <= len(table) and table[:len(sent)] == sent
            delta = list(table[len(sent):]) if keeps else list(table)
            self._tables[rid] = list(table)
            chunks.append(ChunkInput(rid, c.start, req.all_token_ids[c.start:c.start + c.num_tokens], c.samples,
                                     delta, not keeps))
        step = StepInput(self._next_id, tuple(new), tuple(chunks), tuple(batch.finished_ids))
        self._next_id += 1
        return step


class WorkerRequests:
    """Worker side: mirror requests and block tables, updated by each StepInput."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.tables: dict[str, list[int]] = {}

    def apply(self, step: StepInput) -> SchedulerOutput:
        for rid in step.finished_ids:
            self.requests.pop(rid, None)
            self.tables.pop(rid, None)
        for n in step.new_requests:
            self.requests[n.request_id] = Request(n.request_id, n.prompt_token_ids, n.sampling_params, 0.0,
                                                  n.eos_token_ids)
            self.tables[n.request_id] = []
        chunks = []
        for c in step.chunks:
            req = self.requests[c.request_id]
            if c.replaces_table:
                self.tables[c.request_id] = list(c.new_blocks)
            else:
                self.tables[c.request_id].extend(c.new_blocks)
            end = c.start + len(c.token_ids)
            tokens = req.all_token_ids
            tokens[c.start:end] = c.token_ids
            if len(tokens) > req.num_prompt_tokens + len(req.output_token_ids):
                req.output_token_ids = tokens[req.num_prompt_tokens:]  # penalties and min_tokens read them
            chunks.append(ScheduledChunk(req, c.start, len(c.token_ids), c.samples))
        return SchedulerOutput(chunks=tuple(chunks), block_tables={c.request_id: self.tables[c.request_id]
                                                                    for c in step.chunks},
                               finished_ids=step.finished_ids)
