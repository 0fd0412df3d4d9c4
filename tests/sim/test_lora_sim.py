"""LoRA in the simulator: adapter sizes and compute in the perf model, loads and evictions, layer-wise loading,
adapter affinity in a simulated cluster, and the adapter-capacity experiment."""
import dataclasses

import pytest

import ecoserve.sim.cluster as cluster_sim
from ecoserve.cluster.events import RequestArrived
from ecoserve.sim.cluster import ClusterSpec, build
from ecoserve.sim.lora import AdapterCache, LoRASimConfig, adapter_bytes, assign_adapters, lora_params_per_rank
from ecoserve.sim.lora_experiment import adapter_capacity, capacity_table
from ecoserve.sim.models import MODELS
from ecoserve.sim.perf import StepWork, make_perf
from ecoserve.sim.workload import synthetic


def test_adapter_size_counts_in_plus_out_of_every_projection():
    m = MODELS.get("llama-2-13b")  # h 5120, 40 layers, no GQA, intermediate 13824
    h, inter = 5120, 13824
    assert lora_params_per_rank(m) == 40 * (4 * 2 * h + 2 * (h + inter) + (inter + h))
    assert adapter_bytes(m, 16) == 16 * lora_params_per_rank(m) * 2
    with pytest.raises(ValueError):
        LoRASimConfig(num_adapters=0)


def test_lora_compute_grows_with_rank_times_tokens():
    perf = make_perf("llama-2-13b", "L20", tp=1)
    m = MODELS.get("llama-2-13b")
    base = StepWork(2048, 4, 4, 2048 * 512, 2048, 2048)
    t0 = perf.work_time(base)
    t8 = perf.work_time(base._replace(lora_rank_tokens=8 * 2048, lora_weight_bytes=adapter_bytes(m, 8)))
    t64 = perf.work_time(base._replace(lora_rank_tokens=64 * 2048, lora_weight_bytes=adapter_bytes(m, 64)))
    assert t0 < t8 < t64
    assert (t64 - t0) > 4 * (t8 - t0)  # compute-bound prefill: the extra scales with the rank
    assert perf.work_time(base._replace(lora_rank_tokens=0)) == t0  # no adapters: the plain model


def test_cache_loads_once_evicts_lru_and_keeps_a_steps_adapters():
    m = MODELS.get("llama-2-13b")
    cache = AdapterCache(m, LoRASimConfig(8, rank=8, max_loras=2, load_bandwidth=1e9))
    one = adapter_bytes(m, 8) / 1e9
    assert cache.load_time({"a"}) == pytest.approx(one)
    assert cache.load_time({"a"}) == 0.0
    assert cache.load_time({"b"}) == pytest.approx(one)
    cache.load_time({"a"})  # a is now the most recent
    assert cache.load_time({"c"}) == pytest.approx(one)
    assert list(cache.resident) == ["a", "c"] and cache.evictions == 1  # b, the least recent, went
    assert cache.load_time({"a", "b", "c"}) == pytest.approx(one)  # more adapters than slots: all stay this step
    assert set(cache.resident) == {"a", "b", "c"} and cache.loads == 4


def test_layerwise_loading_hides_the_copy_behind_compute():
    m = MODELS.get("llama-2-13b")
    overlapped = AdapterCache(m, LoRASimConfig(rank=8, layerwise_loading=True))
    serial = AdapterCache(m, LoRASimConfig(rank=8, layerwise_loading=False))
    assert overlapped.step_time(0.05, 0.02) == pytest.approx(0.05 + 0.02 / 40)
    assert serial.step_time(0.05, 0.02) == pytest.approx(0.07)
    assert overlapped.step_time(0.01, 0.02) == pytest.approx(0.02 + 0.02 / 40)  # longer copy: it shows
    assert overlapped.step_time(0.05, 0.0) == 0.05


def _run(strategy: str, lora: LoRASimConfig | None, n: int = 120):
    spec = ClusterSpec(model="llama-2-13b", gpu="L20", tp=1, num_instances=4, lora=lora)
    wl = synthetic("sharegpt", 4.0, n, seed=1)
    if lora is not None:
        wl = assign_adapters(wl, lora, seed=1)
    return build(strategy, spec, 5.0, 0.2), wl


@pytest.mark.parametrize("strategy", ["vllm", "ecoserve", "distserve"])
def test_cluster_routes_by_affinity_and_reports_resident_adapters(strategy, monkeypatch):
    lora = LoRASimConfig(num_adapters=6, rank=8, max_loras=2)
    sim, wl = _run(strategy, lora)
    res = sim.run(wl, horizon=1000)
    assert len(res.records) == len(wl)  # two slots for six adapters: requests wait for a slot, none is lost
    blind, _ = _run(strategy, lora)  # the same cluster with routers that never see the adapter
    monkeypatch.setattr(cluster_sim, "RequestArrived",
                        lambda rid, n, out, t, lora_name=None: RequestArrived(rid, n, out, t))
    blind_loads = blind.run(wl, horizon=1000).extra["lora_loads"]
    assert res.extra["lora_loads"] < blind_loads, (res.extra["lora_loads"], blind_loads)
    resident = set().union(*(set(sim.status_of(i.instance_id).loras) for i in sim.instances))
    assert resident <= {f"lora-{k}" for k in range(6)} and resident


def test_adapters_slow_steps_down():
    base_sim, wl = _run("vllm", None)
    base = base_sim.run(wl)
    lora = LoRASimConfig(num_adapters=4, rank=64, max_loras=4)
    sim = build("vllm", dataclasses.replace(base_sim.spec, lora=lora), 5.0, 0.2)
    res = sim.run(assign_adapters(wl, lora, seed=1))
    busy = lambda r: sum(i["busy_fraction"] for i in r.extra["instances"]) * r.sim_time
    assert busy(res) > busy(base)


def test_capacity_experiment_reports_the_most_adapters_within_target(tmp_path):
    spec = ClusterSpec(model="llama-2-13b", gpu="L20", tp=1, num_instances=2)
    data = adapter_capacity(tmp_path, spec, "alpaca", rate=2.0, num_requests=40, strategies=("vllm",),
                            rank=8, max_loras=2, counts=(1, 4), target=0.0)
    rows = data["results"]["vllm"]
    assert [r["num_adapters"] for r in rows] == [1, 4] and data["capacity"]["vllm"] == 4
    assert rows[1]["adapter_loads"] >= 4
    assert (tmp_path / "lora.json").exists() and "capacity" in capacity_table(data)
