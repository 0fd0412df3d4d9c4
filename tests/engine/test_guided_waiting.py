"""Requests wait for their grammar outside scheduling: the engine never compiles, a slow grammar fails alone at its
deadline, a bad one fails alone, the cache is bounded and eviction never recompiles a running request's grammar."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from ecoserve.config import EngineArgs
from ecoserve.engine.async_engine import AsyncEngine
from ecoserve.engine.llm import LLM
from ecoserve.engine.llm_engine import LLMEngine
from ecoserve.sampling import SamplingParams
from ecoserve.structured import StructuredOutputsParams
from tests.utils import make_tiny_checkpoint

DEADLINE_S = 30.0  # bound of every wait loop here: generous for a loaded machine


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("waiting") / "tiny", "llama")
    return LLMEngine(EngineArgs(str(path), num_threads=1, max_model_len=256, max_num_seqs=32).create_engine_config())


class Gate:
    """Holds the compilations of the named regexes until opened (and counts every compilation)."""

    def __init__(self, engine: LLMEngine, monkeypatch, *regexes: str) -> None:
        self.opened = threading.Event()
        self.compiled: list[str] = []
        compiler = engine.guided.compiler
        real = compiler._compile

        def gated(spec):
            self.compiled.append(spec.key())
            if spec.regex in regexes:
                self.opened.wait(DEADLINE_S)
            return real(spec)

        monkeypatch.setattr(compiler, "_compile", gated)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(engine, monkeypatch):
    gates = []

    def make(*regexes: str) -> Gate:
        gates.append(Gate(engine, monkeypatch, *regexes))
        return gates[-1]

    yield make
    for g in gates:  # never leave a compile thread blocked
        g.open()


def regex_params(regex: str, max_tokens: int = 30) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(
        regex=regex))


def run_until(engine: LLMEngine, done, outputs: dict | None = None, failed: list | None = None) -> None:
    """Step (sleeping briefly when only grammars are pending) until done(), within DEADLINE_S."""
    end = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < end, "the engine did not get there in time"
        for out in engine.step():
            if outputs is not None:
                outputs.setdefault(out.request_id, []).append(out)
        if failed is not None:
            failed.extend(engine.take_failed().items())
        if engine.last_step_empty:
            time.sleep(0.005)


def text_of(outs) -> str:
    return outs[-1].outputs[0].text  # a request's text so far


def test_a_waiting_request_takes_no_seat_and_others_run(engine, gate):
    regex = r"w[0-9]{3}"
    g = gate(regex)
    engine.add_request("g", [5, 6, 7], regex_params(regex))
    engine.add_request("p", [8, 9, 10], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    sched = engine.scheduler
    assert "g" in sched.waiting_for_grammar and sched.requests["g"] not in sched.waiting
    outputs: dict = {}
    run_until(engine, lambda: "p" not in engine._parents, outputs)
    assert len(outputs["p"][-1].outputs[0].token_ids) == 5 and "g" not in outputs
    assert sched.kv.owned_blocks.get("g") is None  # no KV while it waits
    wait = engine.grammar_wait_s()
    assert wait is not None and 0 < wait <= engine.grammar_compile_timeout_s  # nothing to step: sleep, not spin
    g.open()
    run_until(engine, lambda: "g" not in engine._parents, outputs)
    assert re.fullmatch(regex, text_of(outputs["g"])) and outputs["g"][-1].outputs[0].finish_reason == "stop"
    assert engine.take_failed() == {} and not sched.waiting_for_grammar


def test_a_grammar_past_its_deadline_fails_alone(engine, gate, monkeypatch):
    regex = r"slow[a-c]{2}"
    gate(regex)
    monkeypatch.setattr(engine, "grammar_compile_timeout_s", 0.3)
    engine.add_request("slow", [5, 6], regex_params(regex))
    engine.add_request("ok", [7, 8], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    outputs: dict = {}
    failed: list = []
    run_until(engine, lambda: failed and "ok" not in engine._parents, outputs, failed)
    [(rid, error)] = failed
    assert rid == "slow" and isinstance(error, ValueError)
    assert "did not compile within 0.3 s" in str(error) and "--grammar-compile-timeout" in str(error)
    assert "slow" not in engine._parents and "slow" not in engine.scheduler.requests and "slow" not in outputs
    assert len(outputs["ok"][-1].outputs[0].token_ids) == 40  # the other request ran to its end meanwhile
    assert not engine.has_unfinished_requests()


def test_a_bad_grammar_fails_alone_and_then_at_once(engine, gate):
    bad = r"(unclosed"
    g = gate(bad)
    engine.add_request("bad", [5, 6], regex_params(bad))  # compiling: nothing to report yet
    g.open()
    failed: list = []
    run_until(engine, lambda: bool(failed), failed=failed)
    [(rid, error)] = failed
    assert rid == "bad" and isinstance(error, ValueError) and "invalid structured output (regex)" in str(error)
    with pytest.raises(ValueError, match="invalid structured output"):  # known bad now: refused, nothing queued
        engine.add_request("bad2", [5, 6], regex_params(bad))
    assert not engine.has_unfinished_requests()


def test_cache_is_bounded_and_eviction_never_recompiles_a_running_request(engine, gate, monkeypatch):
    g = gate()  # counts compilations, holds none
    compiler = engine.guided.compiler
    monkeypatch.setattr(compiler, "max_cached", 1)
    first, second = r"x[0-9]{5}", r"y[a-f]{5}"
    engine.add_request("a", [5, 6, 7], regex_params(first))
    outputs: dict = {}
    run_until(engine, lambda: "a" in outputs, outputs)  # "a" has its grammar and is decoding
    engine.add_request("b", [5, 6, 8], regex_params(second))  # evicts the first grammar from the cache
    assert len(compiler) == 1
    run_until(engine, lambda: not engine.has_unfinished_requests(), outputs)
    assert re.fullmatch(first, text_of(outputs["a"])) and re.fullmatch(second, text_of(outputs["b"]))
    assert g.compiled == [StructuredOutputsParams(regex=first).key(), StructuredOutputsParams(regex=second).key()]


def test_abort_while_waiting_leaves_nothing(engine, gate):
    regex = r"abort[0-9]"
    gate(regex)
    engine.add_request("w", [5, 6], regex_params(regex))
    assert engine.abort_request("w") == ["w"]
    assert not engine.scheduler.waiting_for_grammar and not engine.has_unfinished_requests()
    assert engine.grammar_wait_s() is None and engine.take_failed() == {}


@pytest.mark.parametrize("compiled_first", [False, True])
def test_a_grammar_continues_over_tokens_it_took_elsewhere(engine, gate, compiled_first):
    """A decode leg (or a continued request) starts its grammar after the outputs at the prompt's end."""
    regex = r"ab[0-9]{3}"
    g = gate(regex)
    carried = engine.tokenizer.encode("ab")
    if compiled_first:
        g.open()
        engine.guided.compiler.compile(StructuredOutputsParams(regex=regex), DEADLINE_S)
    rid = f"leg-{compiled_first}"
    engine.add_request(rid, [5, 6, 7, *carried], regex_params(regex), grammar_accepted=carried)
    assert (rid in engine.scheduler.waiting_for_grammar) is not compiled_first
    g.open()
    outputs: dict = {}
    run_until(engine, lambda: rid not in engine._parents, outputs)
    text = text_of(outputs[rid])
    assert re.fullmatch(r"[0-9]{3}", text), text


def test_async_engine_sleeps_while_only_grammars_wait(engine, gate, monkeypatch):
    regex = r"async[0-9]{2}"
    g = gate(regex)
    steps = []
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.append(1) or real_step())

    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        stream = ae.generate("a1", [5, 6, 7], regex_params(regex))
        await asyncio.sleep(0.6)
        assert len(steps) < 30, f"{len(steps)} steps in 0.6 s with nothing to schedule: the loop spins"
        assert ae.num_waiting() == 1  # it counts against --max-waiting-requests
        g.open()  # the compile's callback wakes the loop
        outs = [o async for o in stream]
        assert re.fullmatch(regex, text_of(outs))
        monkeypatch.setattr(engine, "grammar_compile_timeout_s", 0.3)
        slow = r"async-slow[0-9]"
        gate(slow)
        with pytest.raises(ValueError, match="did not compile within 0.3 s"):
            [o async for o in ae.generate("a2", [5, 6], regex_params(slow))]
        with pytest.raises(ValueError, match="did not compile within 0.3 s"):
            await ae.check_grammar(StructuredOutputsParams(regex=slow))  # the API's check: a 400, never a hang
        await ae.stop()

    asyncio.run(asyncio.wait_for(main(), DEADLINE_S * 2))


def test_offline_llm_waits_for_grammars_and_reports_a_deadline(engine, gate, monkeypatch):
    llm = LLM.__new__(LLM)  # the module's engine behind the offline API (no second model load)
    llm.llm_engine, llm._ids = engine, iter(range(10**6))
    regex = r"offline[0-9]{2}"
    g = gate(regex)
    threading.Timer(0.3, g.open).start()
    [out] = llm.generate([{"prompt_token_ids": [5, 6]}], regex_params(regex), use_tqdm=False)
    assert re.fullmatch(regex, out.outputs[0].text)
    monkeypatch.setattr(engine, "grammar_compile_timeout_s", 0.3)
    slow = r"offline-slow[0-9]"
    gate(slow)
    with pytest.raises(ValueError, match=r"prompt 1: .*did not compile within 0.3 s"):
        llm.generate([{"prompt_token_ids": [5, 6]}] * 2,
                     [SamplingParams(max_tokens=3), regex_params(slow)], use_tqdm=False)
    assert not engine.has_unfinished_requests()
