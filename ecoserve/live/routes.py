"""The cluster's own HTTP surface, added to the OpenAI server: `GET /cluster`, `POST /cluster/scale`, and
per-instance series on `/metrics`."""
from __future__ import annotations

from dataclasses import asdict
from typing import Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ecoserve.cluster.topology import Topology
from ecoserve.live.board import InstanceView, WindowLengths
from ecoserve.states import INSTANCE_STATES, PHASES


class ClusterReadout(Protocol):
    """What the routes and the collector read from the frontend."""

    @property
    def counters(self) -> dict[str, int]: ...

    def views(self) -> list[InstanceView]: ...

    def topology(self) -> Topology | None: ...

    def window_lengths(self) -> dict[int, WindowLengths]: ...

    @property
    def recent_migrations(self) -> list[dict]: ...

    def scale_by_hand(self, macro: int, delta: int) -> list[dict]: ...


_CLUSTER_COUNTERS = (
    ("reroutes", "Requests re-routed after their instance was lost."),
    ("instance_deaths", "Instances declared lost."),
    ("kv_bytes_moved", "KV bytes transferred between instances."),
    ("refused_instances", "Instances refused at connect (version or model mismatch)."),
    ("migrations", "Started streams moved to another instance after theirs was lost."),
    ("migration_failures", "Started streams that could not move on and ended with an error."),
    ("restarts", "Lost instances restarted by the frontend."),
    ("rejected_messages", "Messages dropped for a wrong sender (news of a request another instance runs)."),
    ("mitosis_events", "Mitosis steps applied to the topology (add, split, drain, merge, release)."))


class ClusterCollector:
    """Per-instance series, the macro-instance topology and cluster counters, read from the frontend when
    scraped (label `model_name` on all, `instance` on the per-instance ones)."""

    def __init__(self, cluster: ClusterReadout, model_name: str, prefix: str) -> None:
        self.cluster, self.model_name, self.prefix = cluster, model_name, prefix

    def collect(self):
        labels = ["model_name", "instance"]

        def gauge(name: str, doc: str, extra: list[str] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(self.prefix + name, doc, labels=labels + list(extra))

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(self.prefix + name, doc, labels=labels)

        phase = gauge("instance_phase", "1 for the instance's current phase (idle, prefill, decode).", ["phase"])
        state = gauge("instance_state", "1 for the instance's state (starting, ready, draining, free, lost).",
                      ["state"])
        age = gauge("instance_status_age_seconds", "Seconds since the instance's last status.")
        reqs = gauge("instance_num_requests", "Requests the frontend has running on the instance.")
        free = gauge("instance_free_kv_tokens", "Free KV tokens the instance last reported.")
        running = gauge("instance_num_running", "Requests running on the instance, as it last reported.")
        waiting = gauge("instance_num_waiting", "Requests queued on the instance, as it last reported.")
        window_open = gauge("instance_window_open", "1 while the frontend holds the instance's prefill window open.")
        windows = counter("instance_windows", "Prefill windows opened on the instance.")
        routed = counter("instance_requests_routed", "Requests the controller dispatched to the instance.")
        restarts = counter("instance_restarts", "Times the frontend restarted the instance's process.")
        lengths = HistogramMetricFamily(self.prefix + "instance_window_length_seconds",
                                        "Length of the instance's prefill windows, observed as each closes.",
                                        labels=labels)
        window_lengths = self.cluster.window_lengths()
        for v in self.cluster.views():
            lab = [self.model_name, str(v.id)]
            for p in PHASES:
                phase.add_metric(lab + [p], float(p == v.phase))
            for s in INSTANCE_STATES:
                state.add_metric(lab + [s], float(s == v.state))
            reqs.add_metric(lab, v.num_requests)
            window_open.add_metric(lab, float(v.window_open))
            windows.add_metric(lab, v.num_windows)
            routed.add_metric(lab, v.num_dispatched)
            restarts.add_metric(lab, v.restarts)
            if v.status_age_s is not None:
                age.add_metric(lab, v.status_age_s)
                free.add_metric(lab, v.free_kv_tokens)
                running.add_metric(lab, v.num_running)
                waiting.add_metric(lab, v.num_waiting)
            wl = window_lengths.get(v.id)
            if wl is not None:
                lengths.add_metric(lab, wl.cumulative(), wl.total_s)
        yield from (phase, state, age, reqs, free, running, waiting, window_open, windows, routed, restarts, lengths)
        yield self._topology()
        counters = self.cluster.counters
        for key, doc in _CLUSTER_COUNTERS:
            c = CounterMetricFamily(self.prefix + "cluster_" + key, doc, labels=["model_name"])
            c.add_metric([self.model_name], counters[key])
            yield c

    def _topology(self) -> GaugeMetricFamily:
        """1 per instance in a macro instance, with its role: a change of membership is a mitosis step."""
        g = GaugeMetricFamily(self.prefix + "cluster_macro_instance",
                              "1 for each instance of a macro instance (EcoServe), with the instance's role.",
                              labels=["model_name", "macro", "instance", "role"])
        topo = self.cluster.topology()
        if topo is not None:
            for macro, members in topo.macros.items():
                for iid in members:
                    g.add_metric([self.model_name, str(macro), str(iid), topo.roles.get(iid, "both")], 1.0)
        return g


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

    timeline_route(router, cluster)
    return router


def timeline_route(router: APIRouter, cluster) -> None:
    """`GET /cluster/timeline`: phase per instance over time, prefill windows, routed requests (what
    `ecoserve bench serve --plot` draws); `cluster` has `cluster_timeline() -> ClusterTimeline`."""

    @router.get("/cluster/timeline")
    async def timeline() -> dict:
        return cluster.cluster_timeline().to_json()
