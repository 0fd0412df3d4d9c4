"""The cluster's HTTP surface: the OpenAI app of `ecoserve.server` over a ClusterEngine, plus
`GET /cluster`, `POST /cluster/scale` and per-instance series on `/metrics`."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ecoserve.live.board import STATES
from ecoserve.server.errors import bad_request
from ecoserve.server.metrics import DEFAULT_PREFIX, ServerMetrics

PHASES = ("idle", "prefill", "decode")


class ClusterCollector:
    """Per-instance gauges and cluster counters, read from the frontend's board when scraped."""

    def __init__(self, engine, model_name: str, prefix: str) -> None:
        self.engine, self.model_name, self.prefix = engine, model_name, prefix

    def collect(self):
        now = time.monotonic()
        hs = list(self.engine.board.instances.values())
        labels = ["model_name", "instance"]

        def gauge(name: str, doc: str, extra: list[str] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(self.prefix + name, doc, labels=labels + list(extra))

        phase = gauge("instance_phase", "1 for the instance's current phase (idle, prefill, decode).", ["phase"])
        state = gauge("instance_state", "1 for the instance's state (starting, ready, draining, free, lost).",
                      ["state"])
        age = gauge("instance_status_age_seconds", "Seconds since the instance's last status.")
        reqs = gauge("instance_num_requests", "Requests the frontend has running on the instance.")
        free = gauge("instance_free_kv_tokens", "Free KV tokens the instance last reported.")
        windows = CounterMetricFamily(self.prefix + "instance_windows", "Prefill windows opened on the instance.",
                                      labels=labels)
        for h in hs:
            lab = [self.model_name, str(h.instance_id)]
            current = h.status.phase if h.status is not None else None
            for p in PHASES:
                phase.add_metric(lab + [p], float(p == current))
            for s in STATES:
                state.add_metric(lab + [s], float(s == h.state))
            reqs.add_metric(lab, len(h.requests))
            windows.add_metric(lab, h.num_windows)
            if h.status is not None:
                age.add_metric(lab, now - h.status_received)
                free.add_metric(lab, h.status.free_kv_tokens)
        yield from (phase, state, age, reqs, free, windows)
        for key, doc in (("reroutes", "Requests re-routed after their instance was lost."),
                         ("instance_deaths", "Instances declared lost."),
                         ("kv_bytes_moved", "KV bytes transferred between instances."),
                         ("refused_instances", "Instances refused at connect (version or model mismatch).")):
            c = CounterMetricFamily(self.prefix + "cluster_" + key, doc, labels=["model_name"])
            c.add_metric([self.model_name], self.engine.counters[key])
            yield c


def create_cluster_app(engine, served_model_name: str | None = None, generation_config: str = "auto", *,
                       metrics_prefix: str = DEFAULT_PREFIX, **server_options) -> FastAPI:
    """The OpenAI server's app over `engine` (a ClusterEngine), with the cluster routes added.

    `server_options` are `create_app`'s (API key, tool-call parser)."""
    from ecoserve.server.app import create_app

    name = served_model_name or engine.engine.model_name
    if engine.observer is None:
        engine.observer = ServerMetrics(None, name, metrics_prefix)
        engine.observer.registry.register(ClusterCollector(engine, name, engine.observer.prefix))
    app = create_app(engine, name, generation_config, metrics_prefix=metrics_prefix, **server_options)

    @app.get("/cluster")
    async def cluster() -> dict:
        now = time.monotonic()
        sent = engine.controller.summary()["num_dispatched"] if engine.controller is not None else {}
        return {"instances": [{**h.describe(now), "num_dispatched": sent.get(h.instance_id, 0)}
                              for h in engine.board.instances.values()],
                "counters": dict(engine.counters)}

    @app.post("/cluster/scale")
    async def scale(raw: Request) -> dict:
        try:
            body = await raw.json()
            macro, delta = body["macro"], body["delta"]
        except Exception:
            raise bad_request('the body must be JSON {"macro": m, "delta": +1 or -1}') from None
        if not isinstance(macro, int) or isinstance(macro, bool) or delta not in (1, -1):
            raise bad_request(f"macro must be an integer and delta +1 or -1, got {macro!r} and {delta!r}",
                              param="delta")
        try:
            return {"actions": engine.scale_by_hand(macro, delta)}
        except ValueError as e:
            raise bad_request(str(e), param="macro") from None

    return app
