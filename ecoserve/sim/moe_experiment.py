"""`ecoserve simulate moe_offload`: expert offload on one L20 and its host, by resident experts per layer.

An MoE whose experts do not all fit the GPU keeps `--moe-resident-experts` of each layer on it and the
rest in host memory (sim/moe.py). For each budget that fits and each placement (the APTMoE policy, every
miss loaded over PCIe, every miss computed on the host) the run reports batch-1 decode step time and
offline throughput with its mean TPOT: ShareGPT-shaped requests (input <= 1024, input + output <= 2048)
all arriving at t = 0, served by one vLLM-style instance.
"""
from __future__ import annotations

import json
from pathlib import Path

from ecoserve.sim.cluster import ClusterSpec, build
from ecoserve.sim.experiments import EXPERIMENTS
from ecoserve.sim.metrics import summarize
from ecoserve.sim.models import model as get_model
from ecoserve.sim.moe import PLACEMENTS
from ecoserve.sim.perf import StepWork
from ecoserve.sim.tdpipe_experiment import offline_sharegpt

BUDGETS = (0, 16, 32, 48, 64, 80)


def run_budget(model: str, budget: int, placement: str, num_requests: int, skew: float, gpu: str = "L20") -> dict:
    spec = ClusterSpec(model=model, gpu=gpu, tp=1, num_instances=1, max_num_seqs=256,
                       perf_knobs={"moe_resident_experts": budget, "expert_placement": placement,
                                   "expert_skew": skew})
    perf = spec.perf()
    decode_1 = perf.work_time(StepWork(1, 1, 1, 512.0, 512, 0))  # one sequence at context 512
    row = {"resident_experts": budget, "placement": placement, "kv_capacity_tokens": perf.kv_capacity_tokens,
           "batch1_tpot_ms": decode_1 * 1e3}
    if perf.kv_capacity_tokens < 2048:
        return {**row, "fits": False}
    res = build("vllm", spec, 1e9, 1e9).run(offline_sharegpt(num_requests))
    s = summarize(res.records)
    return {**row, "fits": True, "output_tok_s": s["output_tok_s"], "mean_tpot_ms": s["tpot"]["mean"] * 1e3,
            "num_finished": s["num_finished"]}


@EXPERIMENTS.register("moe_offload")
def moe_offload(out: Path, model: str = "qwen3-30b-a3b", budgets=BUDGETS, placements=PLACEMENTS,
                num_requests: int = 200, skew: float = 0.5) -> dict:
    """Resident experts per layer vs batch-1 TPOT and offline throughput on one L20 + Xeon host; writes
    moe_offload.json and .png."""
    m = get_model(model)
    rows = [run_budget(model, b, p, num_requests, skew) for b in budgets if b <= m.num_experts for p in placements]
    data = {"setting": {"model": model, "gpu": "L20", "host": "xeon-6348", "host_link": "pcie4",
                        "num_requests": num_requests, "expert_skew": skew,
                        "dataset": "sharegpt (input <= 1024, input + output <= 2048), all at t = 0"},
            "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_offload.json").write_text(json.dumps(data, indent=1))
    _plot(out, data)
    print(table(rows))
    return data


def _plot(out: Path, data: dict) -> None:
    """Throughput and batch-1 TPOT by resident experts, one line per placement (moe_offload.png)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.2))
    for placement in dict.fromkeys(r["placement"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["placement"] == placement and r["fits"]]
        budgets = [r["resident_experts"] for r in rows]
        axes[0].plot(budgets, [r["output_tok_s"] for r in rows], marker="o", label=placement)
        axes[1].plot(budgets, [r["batch1_tpot_ms"] for r in rows], marker="o", label=placement)
    for ax, ylabel in ((axes[0], "offline output tokens / s"), (axes[1], "batch-1 TPOT (ms)")):
        ax.set_xlabel("resident experts per layer")
        ax.set_ylabel(f"{ylabel} (simulated)")
        ax.legend(fontsize=7)
    fig.suptitle(f"{data['setting']['model']}, one L20 + {data['setting']['host']} host", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "moe_offload.png", dpi=120)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    lines = [f"{'resident':>8} {'placement':>9} {'KV tokens':>10} {'b1 TPOT ms':>10} {'out tok/s':>10} {'TPOT ms':>8}"]
    for r in rows:
        tail = (f"{r['output_tok_s']:>10.1f} {r['mean_tpot_ms']:>8.1f}" if r["fits"] else f"{'no KV room':>19}")
        lines.append(f"{r['resident_experts']:>8} {r['placement']:>9} {r['kv_capacity_tokens']:>10} "
                     f"{r['batch1_tpot_ms']:>10.1f} {tail}")
    return "\n".join(lines)
