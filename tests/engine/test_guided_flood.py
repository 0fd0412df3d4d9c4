"""300 distinct regex grammars arrive while a greedy stream runs: they compile off the engine thread, so the
stream's inter-token gaps stay bounded (next to its gaps without the flood), and every grammar request completes
with text its regex matches, or fails clearly."""
from __future__ import annotations

import asyncio
import re
import statistics
import threading
import time

import pytest

from ecoserve.config import EngineArgs
from ecoserve.engine.async_engine import AsyncEngine
from ecoserve.engine.llm_engine import LLMEngine
from ecoserve.sampling import SamplingParams
from ecoserve.structured import StructuredOutputsParams
from tests.utils import make_tiny_checkpoint

NUM_GRAMMARS = 300
STREAM_TOKENS = 120
GAP_FACTOR = 25  # x the mean baseline gap; generous: the flood shares the stream's steps (bigger batches, masks)
GAP_FLOOR_S = 1.0  # below this a gap is no stall, whatever the baseline (a loaded 2-core machine jitters)
DEADLINE_S = 300.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("flood") / "tiny", "llama")
    return LLMEngine(EngineArgs(str(path), num_threads=1, max_model_len=256, max_num_seqs=32,
                                grammar_cache_size=64).create_engine_config())


def grammar(i: int) -> str:
    """Distinct regexes, more of them than the cache holds (evictions happen while requests still wait)."""
    return rf"(id{i}|n{i % 7})-[a-z]{{1,{2 + i % 3}}}[0-9]{{{1 + i % 4}}}"


async def gaps_of(stream) -> list[float]:
    last, gaps = None, []
    async for _ in stream:
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now
    return gaps


async def collect(stream):
    outs = [o async for o in stream]
    return outs[-1]


def test_grammar_flood_does_not_stall_a_running_stream(engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)

    compile_threads, step_threads = set(), set()  # the property itself: no compile on the stepping thread
    compile_, step = engine.guided.compiler._compile, engine.step

    def compile_on_record(spec):
        compile_threads.add(threading.get_ident())
        return compile_(spec)

    def step_on_record():
        step_threads.add(threading.get_ident())
        return step()

    engine.guided.compiler._compile, engine.step = compile_on_record, step_on_record

    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        baseline = await gaps_of(ae.generate("base", [5, 6, 7, 8], greedy))
        stream = ae.generate("stream", [5, 6, 7, 8], greedy)
        first = await stream.__anext__()
        assert not first.finished
        flood_task = asyncio.ensure_future(gaps_of(stream))
        results = []
        for i in range(NUM_GRAMMARS):  # all at once, as a burst of API requests would
            spec = StructuredOutputsParams(regex=grammar(i))
            results.append(asyncio.ensure_future(collect(ae.generate(
                f"g{i}", [9, 10 + i % 50], SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=spec)))))
        flood = await flood_task
        done = await asyncio.gather(*results, return_exceptions=True)
        await ae.stop()
        return baseline, flood, done

    try:
        baseline, flood, done = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    finally:
        engine.guided.compiler._compile, engine.step = compile_, step
    assert compile_threads and step_threads and not compile_threads & step_threads
    assert len(baseline) == STREAM_TOKENS - 1 and len(flood) == STREAM_TOKENS - 2  # the first was taken apart
    # gaps as the client sees them (outputs that queued up arrive together: near-zero gaps), so the mean
    bound = max(GAP_FACTOR * statistics.mean(baseline), GAP_FLOOR_S)
    print(f"stream gaps: baseline mean {statistics.mean(baseline) * 1e3:.2f} ms, max {max(baseline) * 1e3:.1f} "
          f"ms; under the flood mean {statistics.mean(flood) * 1e3:.2f} ms, max {max(flood) * 1e3:.1f} ms "
          f"(bound {bound * 1e3:.0f} ms)")
    assert max(flood) < bound, (max(flood), bound)
    for i, out in enumerate(done):
        if isinstance(out, BaseException):  # only a clear error is allowed, never a hang or an engine failure
            assert isinstance(out, ValueError) and "did not compile within" in str(out), repr(out)
            continue
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        assert reason in ("stop", "length"), reason
        if reason == "stop":
            assert re.fullmatch(grammar(i), text), (grammar(i), text)
    completed = sum(1 for out in done if not isinstance(out, BaseException))
    assert completed == NUM_GRAMMARS  # on an idle machine nothing comes near the 30 s compile deadline
    assert not engine.scheduler.waiting_for_grammar and len(engine.guided.compiler) <= 64
