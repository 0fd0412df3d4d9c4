"""The frontend's cluster timeline (no processes): phases from statuses, windows and dispatches from the
controller's actions, served at GET /cluster/timeline and drawn by `bench serve --plot`."""
import io
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from ecoserve.bench.serve import plot_cluster_timeline
from ecoserve.cluster import events as ev
from ecoserve.cluster.status import InstanceStatus
from ecoserve.cluster.timeline import ClusterTimeline, PhaseSegment, RoutedPoint, WindowInterval
from ecoserve.engine.async_engine import ModelFacts
from ecoserve.live.board import InstanceHandle
from ecoserve.live.frontend import ClusterEngine
from ecoserve.live.routes import timeline_route


class Scripted:
    """A controller that answers each event with the next scripted actions."""

    def __init__(self, script: list[list]) -> None:
        self.script = list(script)

    def handle(self, e) -> list:
        return self.script.pop(0) if self.script else []


@pytest.fixture(scope="module")
def recorded():
    """Two instances: 0 holds the window and gets a request, then both report their phases."""
    clock = [0.0]
    real = time.monotonic
    time.monotonic = lambda: clock[0]
    try:
        facts = ModelFacts("m", Path("."), None, 100, frozenset(), 256, {})
        fe = ClusterEngine(facts, lambda *a, **k: None, [0, 1])
        fe.controller = Scripted([[ev.OpenWindow(0), ev.Dispatch("r", 0, 4)], [], [ev.CloseWindow(0)], []])
        fe.dispatcher.apply = lambda actions: None  # no instance processes to send to
        for iid in (0, 1):
            fe.board.add(InstanceHandle(iid, state="ready"))

        def report(at: float, iid: int, phase: str) -> None:
            clock[0] = at
            fe.board.instances[iid].status = InstanceStatus(iid, at, phase, 0.0, (), 100, 100)
            fe.post(ev.InstanceReported(iid))

        clock[0] = 1.0
        fe.post(ev.RequestArrived("r", 8, 4, 1.0))
        report(1.5, 0, "prefill")
        report(2.0, 0, "decode")  # its answer closes the window
        report(2.5, 1, "idle")
        clock[0] = 3.0
        app = FastAPI()
        router = APIRouter()
        timeline_route(router, fe)
        app.include_router(router)
        body = TestClient(app).get("/cluster/timeline").json()
    finally:
        time.monotonic = real
    return body


def test_frontend_records_phases_windows_and_dispatches(recorded):
    tl = ClusterTimeline.from_json(recorded)
    assert tl.instances == [0, 1]
    assert tl.routed == [RoutedPoint(1.0, 0)]
    assert tl.windows == [WindowInterval(0, 1.0, 2.0)]
    assert PhaseSegment(0, 1.5, 2.0, "prefill") in tl.phases and PhaseSegment(0, 2.0, 3.0, "decode") in tl.phases
    assert PhaseSegment(1, 2.5, 3.0, "idle") in tl.phases


class _Reply(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bench_plot_fetches_the_timeline(recorded, tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(urllib.request, "urlopen",
                        lambda url, timeout=None: seen.append(url) or _Reply(json.dumps(recorded).encode()))
    path = tmp_path / "timeline.png"
    assert plot_cluster_timeline("http://x:1", str(path))
    assert seen == ["http://x:1/cluster/timeline"]
    assert path.stat().st_size > 1000 and "cluster timeline written" in capsys.readouterr().out


def test_bench_plot_skips_a_single_engine(tmp_path, monkeypatch, capsys):
    def not_found(url, timeout=None):
        raise urllib.error.HTTPError(url, 404, "Not Found", None, None)
    monkeypatch.setattr(urllib.request, "urlopen", not_found)
    path = tmp_path / "timeline.png"
    assert not plot_cluster_timeline("http://x:1", str(path))
    assert not path.exists() and "not a cluster" in capsys.readouterr().err
