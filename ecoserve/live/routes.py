"""The cluster's own HTTP surface, added to the OpenAI server: `GET /cluster`, `POST /cluster/scale`, and
per-instance series on `/metrics`."""
from __future__ import annotations

from dataclasses import asdict
from typing import Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ecoserve.live.board import InstanceView
from ecoserve.states import INSTANCE_STATES, PHASES


class ClusterReadout(Protocol):
    """What the routes and the collector read from the frontend."""

    @property
    def counters(self) -> dict[str, int]: ...

    def views(self) -> list[InstanceView]: ...

    @property
    def recent_migrations(self) -> list[dict]: ...

    def scale_by_hand(self, macro: int, delta: int) -> list[dict]: ...


class ClusterCollector:
    """Per-instance gauges and cluster counters, read from the frontend when scraped."""

    def __init__(self, cluster: ClusterReadout, model_name: str, prefix: str) -> None:
        self.cluster, self.model_name, self.prefix = cluster, model_name, prefix

    def collect(self):
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
        for v in self.cluster.views():
            lab = [self.model_name, str(v.id)]
            for p in PHASES:
                phase.add_metric(lab + [p], float(p == v.phase))
            for s in INSTANCE_STATES:
                state.add_metric(lab + [s], float(s == v.state))
            reqs.add_metric(lab, v.num_requests)
            windows.add_metric(lab, v.num_windows)
            if v.status_age_s is not None:
                age.add_metric(lab, v.status_age_s)
                free.add_metric(lab, v.free_kv_tokens)
        yield from (phase, state, age, reqs, free, windows)
        counters = self.cluster.counters
        for key, doc in (("reroutes", "Requests re-routed after their instance was lost."),
                         ("instance_deaths", "Instances declared lost."),
                         ("kv_bytes_moved", "KV bytes transferred between instances."),
                         ("refused_instances", "Instances refused at connect (version or model mismatch)."),
                         ("migrations", "Started streams moved to another instance after theirs was lost."),
                         ("migration_failures", "Started streams that could not move on and ended with an "
                                                "error."),
                         ("restarts", "Lost instances restarted by the frontend."),
                         ("rejected_messages", "Messages dropped for a wrong sender (news of a request another "
                                               "instance runs).")):
            c = CounterMetricFamily(self.prefix + "cluster_" + key, doc, labels=["model_name"])
            c.add_metric([self.model_name], counters[key])
            yield c


def _bad_request(message: str, param: str | None = None) -> JSONResponse:
    """A 400 in OpenAI's error shape, as the server's own routes answer."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=400)


def cluster_router(cluster: ClusterReadout) -> APIRouter:
    router = APIRouter()

    @router.get("/cluster")
    async def instances() -> dict:
        views = cluster.views()
        return {"instances": [{**asdict(v), "status_age_s": None if v.status_age_s is None
                               else round(v.status_age_s, 3)} for v in views],
                "counters": dict(cluster.counters), "recent_migrations": list(cluster.recent_migrations)}

    # tagged admin: it drains instances, so the server serves it only with --enable-admin-api
    @router.post("/cluster/scale", response_model=None, tags=["admin"])
    async def scale(raw: Request) -> dict | JSONResponse:
        try:
            body = await raw.json()
            macro, delta = body["macro"], body["delta"]
        except Exception:
            return _bad_request('the body must be JSON {"macro": m, "delta": +1 or -1}')
        if not isinstance(macro, int) or isinstance(macro, bool) or delta not in (1, -1):
            return _bad_request(f"macro must be an integer and delta +1 or -1, got {macro!r} and {delta!r}",
                                param="delta")
        try:
            return {"actions": cluster.scale_by_hand(macro, delta)}
        except ValueError as e:
            return _bad_request(str(e), param="macro")

    return router
