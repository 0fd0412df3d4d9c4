"""The output hold on the frontend (no processes): held tokens reach the client at the release, or at
once when the request finishes; the metrics the client is shown use those delivery times."""
import time
from pathlib import Path

import pytest

from ecoserve.cluster import events as ev
from ecoserve.engine.async_engine import ModelFacts
from ecoserve.live import messages as m
from ecoserve.live.board import InstanceHandle
from ecoserve.live.frontend import ClusterEngine
from ecoserve.live.requests import LiveRequest
from ecoserve.sampling import SamplingParams


class Recorder:
    """Controller and step observer at once: what the frontend told each."""

    def __init__(self) -> None:
        self.events, self.steps = [], []

    def handle(self, e) -> list:
        self.events.append(e)
        return []

    def on_step(self, outputs) -> None:
        self.steps.extend(outputs)


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    return now


@pytest.fixture
def frontend():
    facts = ModelFacts("m", Path("."), None, 100, frozenset(), 256, {})
    rec = Recorder()
    fe = ClusterEngine(facts, lambda *a, **k: rec, [0], observer=rec)
    fe.controller = rec
    fe.board.add(InstanceHandle(0, state="ready"))
    req = LiveRequest("r", None, [1, 2, 3], SamplingParams(max_tokens=4), arrival=0.5, deadline=100.0)
    req.instance = 0
    fe.requests["r"] = req
    fe.board.instances[0].requests.add("r")
    return fe, req, rec


def tokens(fe, clock, at: float, ids: list[int], finish: str | None = None) -> None:
    """The instance's step output reaches the frontend at `at`."""
    clock[0] = at
    fe.receiver._outputs(fe.board.instances[0], m.Outputs([m.Delta("r", 0, ids, "x" * len(ids), finish)]), at)


def client_outputs(req: LiveRequest) -> list:
    outs = []
    while not req.outputs.empty():
        outs.append(req.outputs.get_nowait())
    return outs


def test_without_a_hold_tokens_reach_the_client_as_they_come(frontend, clock):
    fe, req, rec = frontend
    tokens(fe, clock, 1.0, [7])
    (out,) = client_outputs(req)
    assert req.first_token == req.first_delivery == out.metrics.first_token_time == 1.0


def test_held_tokens_reach_the_client_at_the_release(frontend, clock):
    fe, req, rec = frontend
    fe.dispatcher.hold(ev.HoldOutput(0))
    tokens(fe, clock, 1.0, [7])
    tokens(fe, clock, 1.5, [8])
    assert client_outputs(req) == [] and req.first_delivery is None and rec.steps == []
    clock[0] = 3.0
    fe.dispatcher.hold(ev.ReleaseOutput(0))
    outs = client_outputs(req)
    assert [o.outputs[0].new_token_ids for o in outs] == [[7], [8]]
    assert req.first_token == 1.0 and req.first_delivery == req.last_delivery == 3.0
    assert all(o.metrics.first_token_time == 3.0 for o in outs)
    assert rec.steps[-1].metrics.first_token_time - req.arrival == 2.5  # the Prometheus TTFT's input
    tokens(fe, clock, 4.0, [9, 10], finish="length")
    (last,) = client_outputs(req)
    assert last.finished and (last.metrics.first_token_time, last.metrics.last_token_time) == (3.0, 4.0)
    (done,) = [e for e in rec.events if isinstance(e, ev.RequestFinished)]
    assert done.ttft == 2.5


def test_a_request_finishing_while_held_is_flushed_at_once(frontend, clock):
    fe, req, rec = frontend
    fe.dispatcher.hold(ev.HoldOutput(0))
    tokens(fe, clock, 1.0, [7, 8])
    tokens(fe, clock, 2.0, [9, 10], finish="length")
    outs = client_outputs(req)
    assert [o.outputs[0].new_token_ids for o in outs] == [[7, 8], [9, 10]] and outs[-1].finished
    assert req.first_delivery == req.last_delivery == 2.0
    assert all(o.metrics.first_token_time == 2.0 for o in outs)
    (done,) = [e for e in rec.events if isinstance(e, ev.RequestFinished)]
    assert done.ttft == 1.5  # as the client saw it, not the instance's first token (0.5)
    clock[0] = 3.0
    fe.dispatcher.hold(ev.ReleaseOutput(0))
    assert client_outputs(req) == []  # nothing left to release
