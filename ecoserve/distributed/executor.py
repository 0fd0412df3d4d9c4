"""The executor of a parallel instance: spawns one worker per rank and feeds them StepInputs.

`submit(batch)` sends a step to every rank at once and returns a `StepFuture`; several may be in
flight (the pipeline overlaps them). Every wait has a deadline: a worker that exits, fails, or
stops answering ends the wait with a `WorkerError` naming the rank, all workers are shut down,
and every later call raises the same error (the engine then reports itself dead).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections import deque
from dataclasses import replace
from multiprocessing.connection import wait

from ecoserve.distributed.comm import Topology
from ecoserve.distributed.step import StepInputBuilder
from ecoserve.distributed.worker import HEARTBEAT_INTERVAL_S, StepDone, WorkerFailed, WorkerSpec, worker_main
from ecoserve.sched.interface import SchedulerOutput, StepResult

logger = logging.getLogger(__name__)
STALE_HEARTBEAT_S = max(20 * HEARTBEAT_INTERVAL_S, 1.0)


class WorkerError(RuntimeError):
    """A rank of a parallel instance died, failed or stalled; the instance cannot serve any more."""


class StepFuture:
    """The result of one submitted step; `result()` waits for it (and for the steps before it)."""

    def __init__(self, executor: "MultiprocExecutor", step_id: int) -> None:
        self._executor, self.step_id = executor, step_id

    def done(self) -> bool:
        return self._executor._poll(self.step_id)

    def result(self) -> StepResult:
        return self._executor._wait(self.step_id)


class MultiprocExecutor:
    def __init__(self, spec: WorkerSpec, step_timeout_s: float, startup_timeout_s: float) -> None:
        self.topology: Topology = spec.topology
        self.step_timeout_s = step_timeout_s
        ctx = mp.get_context("spawn")
        world = self.topology.world_size
        self._heartbeats = ctx.Array("d", world, lock=False)
        self._conns, self._procs = [], []
        self.error: WorkerError | None = None
        self._builder = StepInputBuilder()
        self._submitted: deque[tuple[int, float]] = deque()  # (step id, deadline) not yet collected
        self._acks: dict[int, int] = {}  # step id -> ranks that finished it
        self._results: dict[int, StepResult] = {}
        now = time.monotonic()
        for rank in range(world):
            self._heartbeats[rank] = now
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, rank, child, self._heartbeats),
                               name=f"ecoserve-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._acks[-1] = 0
        self._collect(-1, time.monotonic() + startup_timeout_s, "start up")
        logger.info("%d workers ready (tp=%d, pp=%d)", world, self.topology.tp, self.topology.pp)

    # ---- steps ----------------------------------------------------------------------------
    def submit(self, batch: SchedulerOutput, masks=None) -> StepFuture:
        """Send the step to every rank; `masks` (GrammarMasks) go only to the output rank, which samples."""
        self._check()
        step = self._builder.build(batch)
        output_rank = self.topology.output_rank
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(replace(step, masks=masks) if masks is not None and rank == output_rank else step)
            except (BrokenPipeError, OSError) as e:
                self._drain(timeout=1.0)  # a dead process: its sentinel names it
                self._fail(WorkerError(f"could not send step {step.step_id} to worker "
                                       f"{self.topology.describe(rank)}: {e}"))
        self._acks[step.step_id] = 0
        self._submitted.append((step.step_id, time.monotonic() + self.step_timeout_s))
        return StepFuture(self, step.step_id)

    def execute(self, batch: SchedulerOutput, masks=None) -> StepResult:
        return self.submit(batch, masks).result()

    def _wait(self, step_id: int) -> StepResult:
        self._check()
        while step_id in self._acks:
            _, deadline = next(s for s in self._submitted if s[0] == step_id)
            self._collect(step_id, deadline, f"finish step {step_id}")
        return self._results.pop(step_id)

    def _poll(self, step_id: int) -> bool:
        self._check()
        if step_id in self._acks:
            self._drain(timeout=0)
        return step_id not in self._acks

    def check(self) -> None:
        """Raise a WorkerError if a rank has exited, or has not beaten for a step's deadline; never blocks.

        Lets an idle instance notice a lost rank (a busy one notices in its next wait).
        """
        self._check()
        self._drain(timeout=0)
        now = time.monotonic()
        stalled = [r for r in range(self.topology.world_size) if now - self._heartbeats[r] > self.step_timeout_s]
        if stalled:
            self._fail(WorkerError("workers stopped responding: " + ", ".join(
                f"{self.topology.describe(r)} (no heartbeat for {now - self._heartbeats[r]:.1f} s)" for r in stalled)))

    # ---- receiving, with deadlines --------------------------------------------------------
    def _collect(self, step_id: int, deadline: float, what: str) -> None:
        while step_id in self._acks:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(self._timeout_error(step_id, what))
            self._drain(timeout=left)

    def _drain(self, timeout: float) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        ready = wait(self._conns + list(sentinels), timeout=timeout)
        for obj in ready:
            if obj in sentinels:
                continue  # handled below, after any last message of that rank was read
            try:
                msg = obj.recv()
            except (EOFError, OSError):
                continue
            self._handle(msg)
        for obj in ready:
            if obj in sentinels:
                rank = sentinels[obj]
                conn = self._conns[rank]
                while conn.poll():  # a final failure report beats the bare exit code
                    try:
                        self._handle(conn.recv())
                    except (EOFError, OSError):
                        break
                self._procs[rank].join(1.0)  # the sentinel fires before exitcode is set
                code = self._procs[rank].exitcode
                self._fail(WorkerError(f"worker {self.topology.describe(rank)} (pid {self._procs[rank].pid}) "
                                       f"exited unexpectedly with code {code}"))

    def _handle(self, msg) -> None:
        if isinstance(msg, WorkerFailed):
            self._fail(self._failure_error(msg))
        assert isinstance(msg, StepDone)
        if msg.result is not None:
            self._results[msg.step_id] = msg.result
        self._acks[msg.step_id] += 1
        if self._acks[msg.step_id] == self.topology.world_size:
            del self._acks[msg.step_id]
            if self._submitted and self._submitted[0][0] == msg.step_id:
                self._submitted.popleft()
            elif msg.step_id >= 0:
                self._submitted = deque(s for s in self._submitted if s[0] != msg.step_id)

    def _failure_error(self, msg: WorkerFailed) -> WorkerError:
        """A rank's error often follows a peer's death (its collective broke): name the dead peer first."""
        others = {p.sentinel: r for r, p in enumerate(self._procs) if r != msg.rank}
        wait(list(others), timeout=1.0)
        dead = [r for r, p in enumerate(self._procs) if r != msg.rank and not p.is_alive()]
        failed = f"worker {self.topology.describe(msg.rank)} failed:\n{msg.error}"
        if dead:
            names = ", ".join(f"{self.topology.describe(r)} (pid {self._procs[r].pid}, exit code "
                              f"{self._procs[r].exitcode})" for r in dead)
            return WorkerError(f"worker {names} exited unexpectedly; then {failed}")
        return WorkerError(failed)

    def _timeout_error(self, step_id: int, what: str) -> WorkerError:
        now = time.monotonic()
        stale = [r for r in range(self.topology.world_size) if now - self._heartbeats[r] > STALE_HEARTBEAT_S]
        if stale:
            names = ", ".join(f"{self.topology.describe(r)} (no heartbeat for {now - self._heartbeats[r]:.1f} s)"
                              for r in stale)
            return WorkerError(f"workers did not {what} in time: {names} stopped responding")
        return WorkerError(f"workers did not {what} within the deadline ({self.step_timeout_s:.0f} s per step); "
                           f"every rank is alive, so a collective is stuck or the step is too slow")

    # ---- failure and shutdown -------------------------------------------------------------
    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _fail(self, error: WorkerError):
        if self.error is None:
            self.error = error
            logger.error("%s", error)
            self.shutdown(graceful=False)
        raise self.error

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker: ask them to leave (graceful), then terminate what is left."""
        if graceful and self.error is None:
            for conn in self._conns:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            end = time.monotonic() + 5.0
            for p in self._procs:
                p.join(max(end - time.monotonic(), 0))
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
