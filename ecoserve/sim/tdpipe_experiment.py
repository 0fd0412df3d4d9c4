"""`ecoserve simulate tdpipe`: TD-Pipe against TP and plain PP on one 4 x L20 PCIe node, in virtual time.

The paper's setting (TD-Pipe's README benchmark): Llama-2-13B, 5,000 ShareGPT-shaped requests
with inputs <= 1024 and input + output <= 2048, all arriving at t = 0 (offline), ignore_eos,
max_tokens = the recorded output length. Step times come from the authors' measured L20 table
(plus KV reads, which the table does not contain); TP adds PCIe all-reduces from the network
model, PP a hidden-state send per stage boundary. The three instances run the same scheduler:

- tp: TP=4, one batch at a time, vLLM-style separate batching (`prefill_first`);
- pp: PP=4, one `prefill_first` scheduler with 256 seats and all the KV feeding 4 batches in flight;
- pp_ve: PP=4 as vLLM V0 runs it, one `prefill_first` scheduler per stage (virtual engines), each
  with a quarter of the KV blocks, 256 seats (vLLM's max_num_seqs is per virtual engine) and one
  batch in flight, a request staying with the scheduler that had the fewest unfinished requests
  when it arrived;
- pp_ve_64: the same with the seats split too (64 per virtual engine, 256 in all);
- tdpipe: PP=4, 4 batches in flight, the `tdpipe` policy; predicted output lengths are the
  bucket means of the workload's own lengths (buckets 42/141/294/503, the authors' for
  Llama-2-13B-chat), i.e. a perfect bucket classifier.
"""
from __future__ import annotations

import json
from pathlib import Path

from ecoserve.config import SchedulerConfig, TDPipeConfig
from ecoserve.sched.predictors import BucketMeans
from ecoserve.sched.tdpipe import DEFAULT_PROFILE
from ecoserve.sim.experiments import EXPERIMENTS
from ecoserve.sim.hardware import gpu as get_gpu, link as get_link
from ecoserve.sim.models import model as get_model
from ecoserve.sim.perf import make_perf
from ecoserve.sim.pipeline import ParallelPerf, PipelineInstance, kv_capacity_blocks
from ecoserve.sim.workload import SimRequest, synthetic

PAPER = {"tdpipe_over_pp": 2.73, "tdpipe_over_tp": 1.91}  # "up to", 4 GPUs, PCIe-only (TD-Pipe abstract)


def offline_sharegpt(num_requests: int, seed: int = 0) -> list[SimRequest]:
    """ShareGPT-shaped lengths filtered as TD-Pipe's benchmark does, all arriving at t = 0."""
    out: list[SimRequest] = []
    batch = 0
    while len(out) < num_requests:
        for r in synthetic("sharegpt", 1.0, 2 * num_requests, seed=seed + batch):
            if r.input_len <= 1024 and r.input_len + r.output_len <= 2048 and len(out) < num_requests:
                out.append(SimRequest(f"r{len(out)}", 0.0, r.input_len, r.output_len))
        batch += 1
    return out


SETTINGS = ("tp", "pp", "pp_ve", "pp_ve_64", "tdpipe")
LABELS = {"tp": "TP", "pp": "PP, one scheduler", "pp_ve": "PP, virtual engines",
          "pp_ve_64": "PP, virtual engines, 64 seats each", "tdpipe": "TD-Pipe"}


def run_setting(name: str, requests: list[SimRequest], model: str = "llama-2-13b", gpu: str = "L20",
                num_gpus: int = 4, profile: str | Path | None = None):
    """One of SETTINGS on `num_gpus` GPUs; returns its PipelineRun."""
    spec, dev = get_model(model), get_gpu(gpu)
    base = make_perf(spec, dev, profile=profile or DEFAULT_PROFILE)
    link = get_link(dev.intra_node_link)
    blocks = kv_capacity_blocks(spec, dev, num_gpus)
    if name == "tp":
        perf, policy = ParallelPerf(base, spec, tp=num_gpus, link=link), "prefill_first"
    else:
        perf, policy = ParallelPerf(base, spec, pp=num_gpus, link=link), "tdpipe" if name == "tdpipe" else "prefill_first"
    tdpipe = TDPipeConfig(profile=str(profile or DEFAULT_PROFILE), num_stages=perf.pp,
                          predictor=BucketMeans.from_lengths([r.output_len for r in requests]))
    sched = SchedulerConfig(policy=policy, max_num_batched_tokens=2048,
                            max_num_seqs=4096 if policy == "tdpipe" else 256, tdpipe=tdpipe)
    seats = {"pp_ve": 256, "pp_ve_64": 64}.get(name)
    return PipelineInstance(perf, sched, blocks, max_model_len=2048, virtual_engines=seats is not None,
                            seats_per_engine=seats).run(requests)


@EXPERIMENTS.register("tdpipe")
def tdpipe(out: Path, num_requests: int = 5000, seed: int = 0) -> dict:
    """Offline throughput of TP=4, PP=4 (both ways) and TD-Pipe (PP=4) for Llama-2-13B on 4 x L20; writes tdpipe.json/.png."""
    requests = offline_sharegpt(num_requests, seed)
    runs = {name: run_setting(name, requests) for name in SETTINGS}
    data = {
        "throughput": {k: r.throughput for k, r in runs.items()},
        "output_throughput": {k: r.output_throughput for k, r in runs.items()},
        "ratios": {"tdpipe_over_pp": runs["tdpipe"].throughput / runs["pp"].throughput,
                   "tdpipe_over_pp_ve": runs["tdpipe"].throughput / runs["pp_ve"].throughput,
                   "tdpipe_over_pp_ve_64": runs["tdpipe"].throughput / runs["pp_ve_64"].throughput,
                   "tdpipe_over_tp": runs["tdpipe"].throughput / runs["tp"].throughput},
        "labels": LABELS,
        "paper": PAPER,
        "setting": {"model": "llama-2-13b", "gpu": "L20", "num_gpus": 4, "link": "pcie4",
                    "num_requests": num_requests, "dataset": "sharegpt (input <= 1024, input + output <= 2048)",
                    "profile": DEFAULT_PROFILE.name},
        "runs": {k: {"makespan_s": r.makespan, "num_finished": r.num_finished, "output_tokens": r.output_tokens,
                     "num_batches": r.num_batches, "median_batch_seqs": r.median_batch_seqs,
                     "num_preemptions": r.num_preemptions,
                     "stage_utilisation": [b / r.makespan for b in r.stage_busy]} for k, r in runs.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tdpipe.json").write_text(json.dumps(data, indent=1))
    _plot(out, data)
    return data


def _plot(out: Path, data: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(data["throughput"])
    labels = [data.get("labels", {}).get(n, n).replace(", ", ",\n") for n in names]
    colours = {"tp": "#888", "tdpipe": "#c63"}
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    for ax, key, ylabel in ((axes[0], "throughput", "requests / s"), (axes[1], "output_throughput", "output tokens / s")):
        values = [data[key][n] for n in names]
        bars = ax.bar(range(len(names)), values, color=[colours.get(n, "#58a") for n in names])
        for b, n in zip(bars, names):
            util = data["runs"][n]["stage_utilisation"]
            ax.annotate(f"util {sum(util) / len(util):.2f}\npre {data['runs'][n]['num_preemptions']}",
                        (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(names)), labels, fontsize=6)
        ax.set_ylabel(f"{ylabel} (simulated)")
        ax.set_ylim(0, max(values) * 1.2)
    fig.suptitle("Llama-2-13B, 4 x L20 PCIe, ShareGPT offline (util: mean stage utilisation, pre: preemptions)",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tdpipe.png", dpi=120)
    plt.close(fig)
