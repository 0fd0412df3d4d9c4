"""An instance's loop while grammars compile: it keeps beating and serving other requests, a decode leg's grammar
continues over the tokens the prefill leg produced once it is ready, and a grammar past its deadline fails that
request alone with a RequestFailed that says why. The frontend is a ROUTER socket on loopback, in this test."""
from __future__ import annotations

import re
import threading
import time

import pytest
import zmq

from ecoserve.config import EngineArgs
from ecoserve.engine.llm_engine import LLMEngine
from ecoserve.live import messages as m
from ecoserve.live.engines import RealEngine
from ecoserve.live.instance import InstanceLoop, InstanceOptions
from ecoserve.sampling import SamplingParams
from ecoserve.structured import StructuredOutputsParams
from tests.utils import make_tiny_checkpoint

DEADLINE_S = 60.0
SLOW, LEG = r"never[0-9]", r"ab[0-9]{3}"


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("instance-grammar") / "tiny", "llama")
    engine = LLMEngine(EngineArgs(str(path), num_threads=1, max_model_len=256, grammar_compile_timeout_s=1.0)
                       .create_engine_config())
    gates = {SLOW: threading.Event(), LEG: threading.Event()}
    compiler = engine.guided.compiler
    real = compiler._compile

    def gated(spec):
        gate = gates.get(spec.regex)
        if gate is not None:
            gate.wait(DEADLINE_S)
        return real(spec)

    compiler._compile = gated
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    loop = InstanceLoop(RealEngine(engine), InstanceOptions(f"tcp://127.0.0.1:{port}", heartbeat_s=0.1,
                                                            reconnect_window_s=DEADLINE_S), [])
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", loop.run()), daemon=True)
    thread.start()
    assert router.poll(int(DEADLINE_S * 1000)), "no Ready from the instance"
    ident, frame = router.recv_multipart()
    assert isinstance(m.decode_to_frontend(frame), m.Ready)
    router.send_multipart([ident, m.encode(m.Welcome(1))])
    yield engine, router, ident, gates
    for gate in gates.values():
        gate.set()
    router.send_multipart([ident, m.encode(m.Shutdown())])
    thread.join(DEADLINE_S)
    assert result.get("rc") == 0
    router.close(0)
    ctx.term()


def receive_until(router, ident, done, seq=iter(range(10**6))):
    """Frontend messages until done(msgs) (pinging the instance all along), within DEADLINE_S."""
    msgs, end = [], time.monotonic() + DEADLINE_S
    while not done(msgs):
        assert time.monotonic() < end, [type(x).__name__ for x in msgs[-20:]]
        router.send_multipart([ident, m.encode(m.Ping(time.time()))])
        if router.poll(50):
            msgs.append(m.decode_to_frontend(router.recv_multipart()[1]))
    return msgs


def regex_params(regex: str) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex))


def test_a_grammar_past_its_deadline_fails_alone_while_the_instance_serves(rig):
    engine, router, ident, _ = rig
    engine.grammar_compile_timeout_s = 1.0
    router.send_multipart([ident, m.encode(m.AddRequest(1, "slow", [5, 6, 7], regex_params(SLOW)))])
    router.send_multipart([ident, m.encode(m.AddRequest(2, "plain", [8, 9], SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True)))])

    def done(msgs):
        failed = any(isinstance(x, m.RequestFailed) for x in msgs)
        finished = any(isinstance(x, m.Outputs) and any(d.request_id == "plain" and d.finish_reason
                                                        for d in x.deltas) for x in msgs)
        return failed and finished

    msgs = receive_until(router, ident, done)
    [failed] = [x for x in msgs if isinstance(x, m.RequestFailed)]
    assert failed.request_id == "slow" and "did not compile within 1 s" in failed.reason
    assert sum(isinstance(x, m.Heartbeat) for x in msgs) >= 3  # the loop beat all along
    assert not any(isinstance(x, m.Outputs) and any(d.request_id == "slow" for d in x.deltas) for x in msgs)


def test_a_decode_leg_continues_its_grammar_once_compiled(rig):
    engine, router, ident, gates = rig
    engine.grammar_compile_timeout_s = DEADLINE_S  # read when the request is added: no deadline race here
    carried = engine.tokenizer.encode("ab")
    router.send_multipart([ident, m.encode(m.AddRequest(3, "leg", [5, 6, 7, *carried], regex_params(LEG),
                                                        num_output_tokens=len(carried), num_output_chars=len("ab")))])
    msgs = receive_until(router, ident, lambda msgs: sum(isinstance(x, m.Heartbeat) for x in msgs) >= 3)
    assert not any(isinstance(x, m.Outputs) for x in msgs)  # waiting for its grammar: nothing decoded yet
    gates[LEG].set()

    def finished(msgs):
        return any(isinstance(x, m.Outputs) and any(d.request_id == "leg" and d.finish_reason for d in x.deltas)
                   for x in msgs)

    msgs = receive_until(router, ident, finished)
    text = "".join(d.text for x in msgs if isinstance(x, m.Outputs) for d in x.deltas if d.request_id == "leg")
    assert re.fullmatch(r"[0-9]{3}", text), text
    assert not any(isinstance(x, m.RequestFailed) for x in msgs)
