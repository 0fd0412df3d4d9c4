"""`ecoserve simulate lora`: the most LoRA adapters a simulated cluster serves within its SLOs.

The same requests (a dataset's lengths and SLOs, one rate) are spread over more and more adapters; each
strategy's SLO attainment is measured per count, and its capacity is the largest count at which the
attainment reaches the target. Costs and residency are `sim/lora.py`'s.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ecoserve.sim.cluster import ClusterSpec, build
from ecoserve.sim.lora import LoRASimConfig, assign_adapters
from ecoserve.sim.metrics import attainment
from ecoserve.sim.models import model as get_model
from ecoserve.sim.workload import DATASETS, synthetic

ADAPTER_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def adapter_capacity(out: Path, spec: ClusterSpec, dataset: str = "sharegpt", rate: float = 8.0, num_requests: int = 400,
                     strategies: tuple[str, ...] = ("ecoserve", "vllm"), rank: int = 8, max_loras: int = 4,
                     counts: tuple[int, ...] = ADAPTER_COUNTS, target: float = 0.9, zipf_alpha: float = 0.0,
                     layerwise_loading: bool = True, seed: int = 0) -> dict:
    """SLO attainment at `rate` on the cluster `spec` as the number of adapters
    grows; per strategy, the most adapters at which at least `target` of the requests meet both SLOs (None:
    not even one)."""
    ds = DATASETS.get(dataset)
    ttft, tpot = ds.ttft_slo, ds.tpot_slo
    base = synthetic(dataset, rate, num_requests, seed=seed, max_model_len=get_model(spec.model).max_model_len)
    rows: dict[str, list[dict]] = {}
    for strategy in strategies:
        rows[strategy] = []
        for n in counts:
            lora = LoRASimConfig(n, rank, max_loras, zipf_alpha=zipf_alpha, layerwise_loading=layerwise_loading)
            res = build(strategy, dataclasses.replace(spec, lora=lora), ttft, tpot).run(assign_adapters(base, lora, seed), horizon=max(60.0, 10 * ttft))
            rows[strategy].append({"num_adapters": n, "attainment": attainment(res.records, ttft, tpot,
                                                                                res.num_submitted),
                                   "adapter_loads": res.extra.get("lora_loads", 0)})
    capacity = {s: max((r["num_adapters"] for r in rs if r["attainment"] >= target), default=None)
                for s, rs in rows.items()}
    data = {"model": spec.model, "gpu": spec.gpu, "tp": spec.tp, "num_instances": spec.num_instances,
            "dataset": dataset, "rate": rate, "rank": rank, "max_loras": max_loras,
            "target": target, "ttft_slo": ttft, "tpot_slo": tpot, "zipf_alpha": zipf_alpha,
            "layerwise_loading": layerwise_loading, "capacity": capacity,
            "results": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora.json").write_text(json.dumps(data, indent=1))
    return data


def capacity_table(data: dict) -> str:
    """The attainment of each strategy by number of adapters, and the capacity line."""
    strategies = list(data["results"])
    lines = [f"{'adapters':>9} " + " ".join(f"{s:>10}" for s in strategies)]
    for i, row in enumerate(data["results"][strategies[0]]):
        lines.append(f"{row['num_adapters']:>9} " + " ".join(f"{data['results'][s][i]['attainment']:>10.3f}"
                                                               for s in strategies))
    lines.append(f"{'capacity':>9} " + " ".join(f"{str(data['capacity'][s]):>10}" for s in strategies))
    return "\n".join(lines)
