"""Request traces: one `llm_request` span per request with vLLM's gen_ai.* attributes and timings, the
caller's traceparent continued, and a clear error when tracing is asked for without OpenTelemetry."""
from __future__ import annotations

import builtins
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from tests.server.conftest import start_server  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tiny_model):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    running = start_server(tiny_model, app_kwargs={"tracer_provider": provider})
    yield running, exporter
    running.stop()


def _spans_for(exporter: InMemorySpanExporter, prefix: str, count: int = 1, timeout: float = 5.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.attributes["gen_ai.request.id"].startswith(prefix)]
        if len(spans) >= count or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def _completion(url: str, headers: dict | None = None, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello there", "max_tokens": 5, "temperature": 0.5,
                                                  "top_p": 0.9, "ignore_eos": True, **body},
                   headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_one_completion_one_span_with_vllm_attributes(traced):
    running, exporter = traced
    t0 = time.time_ns()
    out = _completion(running.url)
    t1 = time.time_ns()
    (span,) = _spans_for(exporter, out["id"])
    a = span.attributes
    assert span.name == "llm_request"
    assert a["gen_ai.request.id"] == out["id"] + "-0"
    assert a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.usage.prompt_tokens"] == out["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == out["usage"]["completion_tokens"] == 5
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.n"] == 1
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    queue, ttft, e2e = (a[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_to_first_token", "e2e"))
    assert 0 <= queue <= ttft <= e2e < (t1 - t0) / 1e9
    # the span covers the request: it starts after the client sent it and ends when the engine finished it
    assert t0 <= span.start_time <= span.end_time <= t1
    events = [e.name for e in span.events]
    assert events == ["arrival", "scheduled", "first_token", "finished"]
    stamps = [e.timestamp for e in span.events]
    assert stamps == sorted(stamps)
    assert span.events[-1].attributes["finish_reason"] == "length"
    assert span.parent is None  # no traceparent: a trace of its own


def test_traceparent_continues_the_callers_trace(traced):
    running, exporter = traced
    out = _completion(running.url, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    (span,) = _spans_for(exporter, out["id"])
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_ID


def test_one_span_per_prompt(traced):
    running, exporter = traced
    out = _completion(running.url, prompt=["one", "two"])
    spans = _spans_for(exporter, out["id"], count=2)
    assert sorted(s.attributes["gen_ai.request.id"] for s in spans) == [out["id"] + "-0", out["id"] + "-1"]


def test_without_opentelemetry_the_flag_says_what_to_install(monkeypatch):
    from ecoserve.server.tracing import TracingUnavailableError, otlp_tracer_provider

    real_import = builtins.__import__

    def no_otel(name, *args, **kwargs):
        if name.startswith("opentelemetry"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_otel)
    with pytest.raises(TracingUnavailableError, match=r"pip install ecoserve\[otel\]"):
        otlp_tracer_provider("http://localhost:4317")


def test_without_the_flag_nothing_is_imported():
    import subprocess
    import sys

    # (other libraries may import the bare opentelemetry API; the SDK and our tracer are ours to keep out)
    code = ("import sys; import ecoserve.server.app, ecoserve.server.cli; "
            "assert not [m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'ecoserve.server.tracing'))]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_serve_flag():
    import argparse

    from ecoserve.server.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--otlp-traces-endpoint", "http://collector:4317"])
    assert args.otlp_traces_endpoint == "http://collector:4317"


def test_the_routing_decision_is_an_event_and_attributes():
    from types import SimpleNamespace

    from ecoserve.cluster import events as ev
    from ecoserve.live.actions import Dispatcher
    from ecoserve.sampling import SamplingParams
    from ecoserve.server.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider, "tiny")
    tracer.start("r-0", {}, 3, SamplingParams(max_tokens=4))

    class PaDGController:
        pass

    fe = SimpleNamespace(route_listener=tracer.on_route, controller=PaDGController())
    status = SimpleNamespace(phase="prefill", free_kv_tokens=1024, requests=(1, 2))
    handle = SimpleNamespace(instance_id=1, status=status, window_open=True)
    Dispatcher._report_route(SimpleNamespace(fe=fe), SimpleNamespace(request_id="r-0", lost_from=None), handle,
                             ev.Dispatch("r-0", 1, 4))
    tracer.abort("r-0")
    (span,) = exporter.get_finished_spans()
    routed = [e for e in span.events if e.name == "routed"]
    assert len(routed) == 1
    assert dict(routed[0].attributes) == {
        "ecoserve.route.instance_id": 1, "ecoserve.route.controller": "PaDGController",
        "ecoserve.route.phase": "prefill", "ecoserve.route.window_open": True, "ecoserve.route.free_kv_tokens": 1024,
        "ecoserve.route.num_requests": 2, "ecoserve.route.imported_tokens": 0, "ecoserve.route.reroute": False}
    assert span.attributes["ecoserve.route.instance_id"] == 1
    assert tuple(span.attributes["gen_ai.response.finish_reasons"]) == ("abort",)
