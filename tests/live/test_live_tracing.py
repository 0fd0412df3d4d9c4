"""Request traces on a cluster frontend: each request's span names the instance the controller routed it to."""
from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from tests.live.conftest import mock_args, start_strategy, write_profile  # noqa: E402

PROFILE = [(1, 8.0), (16, 12.0), (64, 25.0), (256, 60.0), (512, 110.0)]


@pytest.fixture(scope="module")
def traced_cluster(tiny_model, tmp_path_factory):
    profile = write_profile(tmp_path_factory.mktemp("tracing") / "profile.csv", PROFILE)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    running = start_strategy(tiny_model, "vllm", 2, mock_args(tiny_model, profile),
                             app_kwargs={"tracer_provider": provider})
    yield running, exporter
    running.stop()


def test_each_span_has_its_routing_decision(traced_cluster):
    running, exporter = traced_cluster
    ids = []
    for i in range(4):
        r = httpx.post(f"{running.url}/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"] + "-0")
    deadline = time.monotonic() + 10
    while len({s.attributes["gen_ai.request.id"] for s in exporter.get_finished_spans()} & set(ids)) < 4:
        assert time.monotonic() < deadline, "not every request's span ended"
        time.sleep(0.1)
    spans = {s.attributes["gen_ai.request.id"]: s for s in exporter.get_finished_spans()}
    instances = {v["id"] for v in running.cluster()}
    assert instances == {0, 1}
    for rid in ids:
        span = spans[rid]
        routed = [e for e in span.events if e.name == "routed"]
        assert routed, f"{rid} has no routing event"
        assert routed[-1].attributes["ecoserve.route.instance_id"] in instances
        assert routed[-1].attributes["ecoserve.route.controller"] != "NoneType"
        assert [e.name for e in span.events][0] == "arrival"
        assert span.attributes["gen_ai.usage.completion_tokens"] == 3
