"""AsyncEngine without HTTP: streams, early close aborts, a dead loop fails everything clearly."""
from __future__ import annotations

import asyncio
import gc
import queue

import httpx
import pytest

from ecoserve.config import EngineArgs
from ecoserve.engine.async_engine import _STUCK_POLL_S, AsyncEngine, EngineDeadError, EngineOverloadedError
from ecoserve.engine.llm_engine import LLMEngine
from ecoserve.sampling import SamplingParams
from tests.server.conftest import ENGINE_KWARGS


@pytest.fixture
def engine(tiny_model) -> LLMEngine:
    return LLMEngine(EngineArgs(tiny_model, **ENGINE_KWARGS).create_engine_config())


def test_streams_early_close_and_overload(engine):
    async def main() -> None:
        ae = AsyncEngine(engine, max_waiting=1)
        ae.start()
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outs = [o async for o in ae.generate("a", [5, 6, 7], params)]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
        assert [len(o.outputs[0].token_ids) for o in outs] == sorted(len(o.outputs[0].token_ids) for o in outs)

        ae.num_waiting = lambda: 1  # as if one request were waiting: the queue (limit 1) is full
        with pytest.raises(EngineOverloadedError):
            ae.generate("c", [5, 6], params)
        del ae.num_waiting
        stream = ae.generate("b", [5, 6, 7], params.clone(max_tokens=200))
        first = await stream.__anext__()
        assert not first.finished
        await stream.aclose()  # the consumer goes away: the request is aborted and its KV freed
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not engine.has_unfinished_requests() and engine.scheduler.kv.usage == 0
        with pytest.raises(ValueError, match="empty"):
            ae.generate("d", [], params)
        await ae.stop()

    asyncio.run(main())


def test_dead_engine_loop_fails_requests_and_health(engine):
    from ecoserve.server.app import create_app

    async def main() -> None:
        ae = AsyncEngine(engine)
        app = create_app(ae, "tiny")
        ae.start()
        real_step, calls = engine.step, []

        def broken_step():
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("boom")
            return real_step()

        engine.step = broken_step
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in ae.generate("x", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True)):
                pass
        assert not ae.is_running
        with pytest.raises(EngineDeadError):
            ae.generate("y", [5, 6], SamplingParams())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.get("/health")
            assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
            r = await client.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        await ae.stop()

    asyncio.run(main())


async def _until_idle(engine: LLMEngine) -> None:
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request was not aborted")


def test_a_stream_never_started_is_aborted_and_forgotten(engine):
    """A client that leaves before the first byte drops a stream nobody iterated: the request must not run on."""
    async def main() -> None:
        ae = AsyncEngine(engine)
        for rid in ("q1", "q2", "q3"):
            ae.abort(rid)  # queued aborts (a burst of disconnects) are not waiting requests
        assert ae.num_waiting() == 0
        ae.start()
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = ae.generate("never", [5, 6, 7], params)
        assert ae.num_waiting() + engine.get_num_unfinished_requests() >= 1
        del stream  # never iterated
        gc.collect()
        await _until_idle(engine)
        assert ae.num_in_flight == 0 and engine.stats["generation_tokens"] < 200
        # one consumed to the end leaves nothing behind either
        outs = [o async for o in ae.generate("done", [5, 6, 7], params.clone(max_tokens=3))]
        assert [len(o.outputs[0].new_token_ids) for o in outs] == [1, 1, 1] and ae.num_in_flight == 0
        await ae.stop()

    asyncio.run(main())


class _RecordingQueue(queue.SimpleQueue):
    """Counts the loop's stuck polls (the idle loop's periodic executor check is another, longer wait)."""

    def __init__(self) -> None:
        self.timed_waits = 0

    def get(self, block=True, timeout=None):
        if block and timeout == _STUCK_POLL_S:
            self.timed_waits += 1
        return super().get(block, timeout)


def test_engine_loop_waits_only_when_nothing_is_schedulable(tiny_model):
    """Prompt-chunk steps sample nothing but did work: the loop must go straight on to the next step."""
    chunky = LLMEngine(EngineArgs(tiny_model, **{**ENGINE_KWARGS, "max_num_batched_tokens": 16})
                       .create_engine_config())

    async def main() -> None:
        ae = AsyncEngine(chunky)
        ae._commands = _RecordingQueue()
        ae.start()
        outs = [o async for o in ae.generate("p", list(range(5, 165)), SamplingParams(max_tokens=2))]
        assert outs[-1].finished and ae._commands.timed_waits == 0  # 10 prompt chunks, no wait
        await ae.stop()

    asyncio.run(main())
