"""Request traces over OpenTelemetry (`--otlp-traces-endpoint`): one `llm_request` span per engine request,
with vLLM's `gen_ai.*` attributes, events for arrival, routing, scheduling, first token and finish, and the
caller's W3C `traceparent` as its parent.

OpenTelemetry is an optional extra (`pip install ecoserve[otel]`): it is imported only when tracing is on.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

from ecoserve.request import RequestOutput
from ecoserve.sampling import SamplingParams

SPAN_NAME = "llm_request"
INSTALL_HINT = "pip install ecoserve[otel]"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"  # grpc (the default) or http/protobuf, as in vLLM


class TracingUnavailableError(RuntimeError):
    """--otlp-traces-endpoint was given but the OpenTelemetry SDK is not installed."""


def _require_otel() -> None:
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise TracingUnavailableError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK, which is not "
                                      f"installed ({e}); {INSTALL_HINT}") from None


def otlp_tracer_provider(endpoint: str, service_name: str = "ecoserve") -> Any:
    """A TracerProvider that batches spans to the OTLP collector at `endpoint` (gRPC, or HTTP with
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf)."""
    _require_otel()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        else:
            raise ValueError(f"{PROTOCOL_ENV} must be grpc or http/protobuf, got {protocol!r}")
    except ImportError as e:
        raise TracingUnavailableError(f"--otlp-traces-endpoint with {PROTOCOL_ENV}={protocol} needs its OTLP "
                                      f"exporter, which is not installed ({e}); {INSTALL_HINT}") from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def _epoch_ns(monotonic_s: float) -> int:
    """An engine time (time.monotonic seconds) as the wall-clock nanoseconds spans carry."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class RequestTracer:
    """Opens a span when a request is queued, adds its routing decision, and closes it with its timings."""

    def __init__(self, tracer_provider: Any, model_name: str) -> None:
        _require_otel()
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = tracer_provider.get_tracer("ecoserve")
        self._propagator = TraceContextTextMapPropagator()
        self.model_name = model_name
        self._spans: dict[str, Any] = {}  # engine request id -> its open span
        self._lock = threading.Lock()  # routing is reported from the cluster frontend's thread

    def start(self, request_id: str, headers: Any, prompt_tokens: int, params: SamplingParams) -> None:
        """Open the request's span, a child of the caller's trace when its headers carry a traceparent."""
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(carrier=dict(headers or {}))
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER)
        span.set_attributes({"gen_ai.request.id": request_id, "gen_ai.response.model": self.model_name,
                             "gen_ai.usage.prompt_tokens": prompt_tokens, "gen_ai.request.n": params.n,
                             "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p})
        if params.max_tokens is not None:
            span.set_attribute("gen_ai.request.max_tokens", params.max_tokens)
        span.add_event("arrival")
        with self._lock:
            self._spans[request_id] = span

    def on_route(self, request_id: str, instance_id: int, reason: dict[str, Any]) -> None:
        """The cluster routed the request: the instance and what the router saw (an event each time: a re-route
        adds another)."""
        with self._lock:
            span = self._spans.get(request_id)
        if span is None:
            return
        attrs = {"ecoserve.route.instance_id": instance_id,
                 **{f"ecoserve.route.{k}": v for k, v in reason.items() if v is not None}}
        span.add_event("routed", attrs)
        span.set_attributes(attrs)

    def finish(self, request_id: str, out: RequestOutput) -> None:
        """Close the span of a finished request with its latencies, token counts and finish reasons."""
        with self._lock:
            span = self._spans.pop(request_id, None)
        if span is None:
            return
        m = out.metrics
        reasons = [c.finish_reason or "stop" for c in out.outputs]
        span.set_attributes({"gen_ai.usage.completion_tokens": sum(c.num_tokens for c in out.outputs),
                             "gen_ai.response.finish_reasons": reasons})
        end_ns = None
        if m is not None:
            if m.first_scheduled_time is not None:
                span.set_attribute("gen_ai.latency.time_in_queue", m.first_scheduled_time - m.arrival_time)
                span.add_event("scheduled", timestamp=_epoch_ns(m.first_scheduled_time))
            if m.first_token_time is not None:
                span.set_attribute("gen_ai.latency.time_to_first_token", m.first_token_time - m.arrival_time)
                span.add_event("first_token", timestamp=_epoch_ns(m.first_token_time))
            if m.finished_time is not None:
                span.set_attribute("gen_ai.latency.e2e", m.finished_time - m.arrival_time)
                end_ns = _epoch_ns(m.finished_time)
        span.add_event("finished", {"finish_reason": reasons[0] if reasons else "stop"}, timestamp=end_ns)
        span.end(end_time=end_ns)

    def abort(self, request_id: str) -> None:
        """Close the span of a request that ended without finishing (the client left, an error)."""
        with self._lock:
            span = self._spans.pop(request_id, None)
        if span is None:
            return
        span.set_attribute("gen_ai.response.finish_reasons", ["abort"])
        span.add_event("finished", {"finish_reason": "abort"})
        span.end()


RouteListener = Callable[[str, int, dict[str, Any]], None]
