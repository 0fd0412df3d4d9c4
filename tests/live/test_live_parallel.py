"""A live instance with --tensor-parallel-size 2: it serves what the single engine serves, and when one of
its ranks is killed the instance exits with ENGINE_DEAD (its engine names the dead rank), the frontend
declares it lost and the request it was streaming ends with an error instead of hanging."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import openai

from ecoserve.live.instance import ENGINE_DEAD
from ecoserve.live.shared import FrontendOptions
from tests.live.conftest import instance_args, single_engine_greedy, start_cluster, wait_until
from tests.live.fakes import FakeNoDG

PROMPT = "The quick brown fox jumps over the lazy dog."


def ranks_of(pid: int) -> list[int]:
    """The spawned rank processes of an instance (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_tp2_instance_serves_then_a_dead_rank_makes_it_lost(tiny_model):
    want = single_engine_greedy(tiny_model, [PROMPT], 8)[0]
    running = start_cluster(tiny_model, lambda step_time, status_of: FakeNoDG([0], status_of), 1,
                            lambda iid: instance_args(tiny_model, "prefill_first", "--tensor-parallel-size", "2",
                                                      "--heartbeat-interval", "0.2"),
                            options=FrontendOptions(max_restarts=0))  # the dead process stays for the checks
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", timeout=60, max_retries=0)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert got.choices[0].text == want.text
        ranks = ranks_of(running.cluster()[0]["pid"])
        assert len(ranks) == 2
        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks, error = iter(stream), None
        next(chunks)  # it is streaming
        os.kill(ranks[1], signal.SIGKILL)
        try:
            for _ in chunks:
                pass
        except openai.APIError as e:
            error = e
        assert error is not None, "the stream ended without an error"
        wait_until(lambda: running.cluster()[0]["state"] == "lost", 20, "the instance to be declared lost")
        wait_until(lambda: running.engine.launcher.exit_code(0) is not None, 20, "the instance to exit")
        # it exits ENGINE_DEAD on its own; under load its engine's shutdown (stopping the surviving rank) can
        # outlast the frontend's patience (no heartbeat, or its sockets closed first), and then the frontend has
        # already declared it lost and killed it
        code, reason = running.engine.launcher.exit_code(0), running.cluster()[0]["lost_reason"]
        assert code == ENGINE_DEAD or (code == -signal.SIGKILL and reason), (code, reason)
        wait_until(lambda: not any(Path(f"/proc/{r}").exists() for r in ranks), 10, "the other rank to stop")
    finally:
        running.stop()
