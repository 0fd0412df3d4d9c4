"""The cluster's own series on the frontend's /metrics, over a 2-instance EcoServe cluster of mock instances:
windows roll (the phase and window series change per instance), routed counts add up to the requests sent,
and every series the cluster dashboard queries exists."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live.conftest import mock_args, start_strategy, write_profile
from tests.live.test_live_mock import PROFILE, PROMPT

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "cluster.json"
PER_INSTANCE = ("instance_phase", "instance_state", "instance_status_age_seconds", "instance_num_requests",
                "instance_free_kv_tokens", "instance_num_running", "instance_num_waiting", "instance_window_open",
                "instance_windows", "instance_requests_routed", "instance_restarts", "instance_window_length_seconds")


def samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Sample name -> (labels, value) for every ecoserve: sample of a scrape."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def per_instance(sample_list: list[tuple[dict, float]], **match: str) -> dict[str, float]:
    return {lab["instance"]: v for lab, v in sample_list if all(lab.get(k) == x for k, x in match.items())}


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    profile = write_profile(tmp_path_factory.mktemp("metrics") / "profile.csv", PROFILE)
    running = start_strategy(tiny_model, "ecoserve", 2, mock_args(tiny_model, profile), ttft_slo=0.5, tpot_slo=0.1)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def load(cluster):
    """Requests at a steady rate while /metrics is scraped every 50 ms: the scrapes taken under load, the codes."""
    scrapes: list[dict] = []
    codes: list[int] = []
    done = threading.Event()

    async def send() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async def one() -> int:
                r = await client.post(f"{cluster.url}/v1/completions",
                                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
                return r.status_code
            tasks = [asyncio.create_task(one())]
            for _ in range(39):
                await asyncio.sleep(0.15)
                tasks.append(asyncio.create_task(one()))
            codes.extend(await asyncio.gather(*tasks))

    sender = threading.Thread(target=lambda: (asyncio.run(send()), done.set()), daemon=True)
    sender.start()
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        scrapes.append(samples(httpx.get(f"{cluster.url}/metrics", timeout=10).text))
        time.sleep(0.05)
    sender.join(timeout=60)
    return scrapes, codes


def test_series_before_load(cluster):
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    got = samples(text)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in PER_INSTANCE:
        assert "ecoserve:" + name in fams, name
    assert fams["ecoserve:instance_window_length_seconds"].type == "histogram"
    assert fams["ecoserve:instance_requests_routed"].type == "counter"
    phases = got["ecoserve:instance_phase"]
    assert {lab["instance"] for lab, _ in phases} == {"0", "1"}
    assert all(lab["model_name"] == "tiny" for lab, _ in phases)
    for inst in ("0", "1"):  # exactly one phase is 1 once the instance has reported
        assert sum(v for lab, v in phases if lab["instance"] == inst) == 1.0
    topo = sorted((lab["macro"], lab["instance"], lab["role"], v) for lab, v in got["ecoserve:cluster_macro_instance"])
    assert topo == [("0", "0", "both", 1.0), ("0", "1", "both", 1.0)]
    assert got["ecoserve:cluster_mitosis_events_total"][0][1] == 0.0


def test_windows_roll_in_the_series(load):
    scrapes, codes = load
    assert codes and all(c == 200 for c in codes), codes
    opens = {"0": set(), "1": set()}
    phases = {"0": set(), "1": set()}
    for s in scrapes:
        for inst, v in per_instance(s["ecoserve:instance_window_open"]).items():
            opens[inst].add(v)
        for lab, v in s["ecoserve:instance_phase"]:
            if v == 1.0:
                phases[lab["instance"]].add(lab["phase"])
    for inst in ("0", "1"):  # each instance's window opened and closed, and its phase moved, while requests ran
        assert opens[inst] == {0.0, 1.0}, (inst, opens, len(scrapes))
        assert len(phases[inst]) >= 2, (inst, phases)
    # the windows alternate: some scrape shows one open and the other closed, each way round
    pairs = {tuple(per_instance(s["ecoserve:instance_window_open"]).get(i) for i in ("0", "1")) for s in scrapes}
    assert {(1.0, 0.0), (0.0, 1.0)} <= pairs, pairs


def test_routed_counts_add_up(cluster, load):
    _, codes = load
    got = samples(httpx.get(f"{cluster.url}/metrics", timeout=10).text)
    routed = per_instance(got["ecoserve:instance_requests_routed_total"])
    assert sum(routed.values()) == len(codes), routed
    assert all(v > 0 for v in routed.values()), routed
    windows = per_instance(got["ecoserve:instance_windows_total"])
    closed = per_instance(got["ecoserve:instance_window_length_seconds_count"])
    for inst in ("0", "1"):  # every window but the one open now was timed when it closed
        assert windows[inst] >= 2
        assert windows[inst] - 1 <= closed[inst] <= windows[inst], (windows, closed)
    total = sum(per_instance(got["ecoserve:instance_window_length_seconds_sum"]).values())
    assert 0 < total < 120
    inf = per_instance(got["ecoserve:instance_window_length_seconds_bucket"], le="+Inf")
    assert inf == closed
    assert set(per_instance(got["ecoserve:instance_num_running"])) == {"0", "1"}
    assert per_instance(got["ecoserve:instance_restarts_total"]) == {"0": 0.0, "1": 0.0}


def _annotation_exprs(dashboard: dict) -> list[str]:
    return [a.get("expr") or a.get("target", {}).get("expr") for a in dashboard["annotations"]["list"]
            if a.get("datasource", {}).get("type") == "prometheus"]


def test_dashboard_is_importable_grafana_json():
    board = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"model_name", "ttft_slo", "tpot_slo"} <= set(variables)
    panels = board["panels"] + [p for row in board["panels"] for p in row.get("panels", [])]
    assert any(p["type"] == "state-timeline" and "instance_phase" in p["targets"][0]["expr"] for p in panels)
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    assert "vector($ttft_slo)" in exprs and "vector($tpot_slo)" in exprs
    assert any("cluster_mitosis_events_total" in e for e in _annotation_exprs(board))


def test_every_dashboard_series_exists(cluster, load):
    """Each series the dashboard's panels and annotations query is in a scrape after requests ran."""
    series = pytest.importorskip("tests.dashboard_series")  # with the vLLM series (TPOT) it checks too
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    wanted = series.dashboard_series(DASHBOARD)
    for expr in _annotation_exprs(json.loads(DASHBOARD.read_text())):
        wanted |= series.expr_series(expr)
    assert any(name.startswith("ecoserve:instance_") for name in wanted)
    missing = wanted - series.scraped_families(text)
    assert not missing, sorted(missing)


class _Readout:
    """A frontend after a split: macro 1 took the free instance 2; instance 1 was restarted once."""

    def __init__(self) -> None:
        from ecoserve.live.board import InstanceBoard, InstanceHandle

        self.board = InstanceBoard()
        for i in range(3):
            self.board.add(InstanceHandle(i, state="ready"))
        self.board[1].restarts = 1
        self.counters = {key: 0 for key in ("reroutes", "instance_deaths", "kv_bytes_moved", "refused_instances",
                                            "migrations", "migration_failures", "restarts", "rejected_messages")}
        self.counters["mitosis_events"] = 1

    def views(self):
        from ecoserve.live.board import view_of

        return [view_of(h, self.topology(), 0, 0.0) for h in self.board.instances.values()]

    def topology(self):
        from ecoserve.cluster.topology import Topology

        return Topology({0: "both", 1: "both", 2: "both"}, {0: (0, 1), 1: (2,)})

    def window_lengths(self):
        return {h.instance_id: h.window_lengths for h in self.board.instances.values()}


def test_collector_topology_restarts_and_window_lengths():
    from prometheus_client import CollectorRegistry, generate_latest

    from ecoserve.live.routes import ClusterCollector

    fe = _Readout()
    h = fe.board[0]
    for opened, closed in ((1.0, 1.02), (2.0, 2.3), (3.0, 403.0)):  # 20 ms, 300 ms, past every bound
        fe.board.window_set(h, True, opened)
        fe.board.window_set(h, True, opened + 0.001)  # opening an open window is no new window
        fe.board.window_set(h, False, closed)
    fe.board.window_set(h, True, 500.0)
    registry = CollectorRegistry()
    registry.register(ClusterCollector(fe, "tiny", "vllm:"))
    got = samples(generate_latest(registry).decode())
    topo = sorted((lab["macro"], lab["instance"], lab["role"]) for lab, _ in got["vllm:cluster_macro_instance"])
    assert topo == [("0", "0", "both"), ("0", "1", "both"), ("1", "2", "both")]
    assert got["vllm:cluster_mitosis_events_total"] == [({"model_name": "tiny"}, 1.0)]
    assert per_instance(got["vllm:instance_restarts_total"]) == {"0": 0.0, "1": 1.0, "2": 0.0}
    assert per_instance(got["vllm:instance_windows_total"])["0"] == 4
    assert per_instance(got["vllm:instance_window_open"]) == {"0": 1.0, "1": 0.0, "2": 0.0}
    buckets = {lab["le"]: v for lab, v in got["vllm:instance_window_length_seconds_bucket"] if lab["instance"] == "0"}
    assert (buckets["0.01"], buckets["0.025"], buckets["0.25"], buckets["0.5"], buckets["300.0"],
            buckets["+Inf"]) == (0, 1, 1, 2, 2, 3)
    assert per_instance(got["vllm:instance_window_length_seconds_sum"])["0"] == pytest.approx(400.32)
    assert "vllm:instance_num_running" not in got  # no status yet: nothing reported to show
