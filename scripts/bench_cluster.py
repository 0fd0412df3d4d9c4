"""The live cluster benchmark: every strategy on the same workload through the same engine.

1. Real: for each strategy, `ecoserve serve --strategy S --num-instances 2 --num-threads 1` on the
   embedded SmolLM2 (FuDG strategies with --pd 1:1), loaded by `ecoserve bench serve` in its own
   process at each request rate: goodput and SLO attainment (both SLOs met, over all prompts sent).
2. Mock vs simulated: the same kind of workload on 8 mock instances (`--mock-profile`, the
   instances sleep the profile's step time) and on the simulator with the same profile and the same
   requests and send times: differences in routing (each instance's share of dispatches, window
   counts) and the TTFT / TPOT mean and p90 absolute percentage errors (MAPE over the four).

    python scripts/bench_cluster.py --out results/cluster      # ~25 min on a shared 2-core machine

Writes OUT/bench_cluster.json and OUT/live_cluster.png; prints both tables (Markdown).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from validate_sim import measure_profile, wait_ready  # noqa: E402 (a script beside this one)

STRATEGIES = ("ecoserve", "vllm", "sarathi", "distserve", "mooncake")
FUDG = ("distserve", "mooncake")
CLI = [sys.executable, "-m", "ecoserve.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_args(a: argparse.Namespace, port: int, rate: float, num_prompts: int, out: Path, name: str) -> list[str]:
    return ["--base-url", f"http://127.0.0.1:{port}", "--tokenizer", a.model_dir, "--dataset-name", "random",
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
            "--random-range-ratio", str(a.range_ratio), "--num-prompts", str(num_prompts),
            "--request-rate", str(rate), "--seed", str(a.seed), "--ignore-eos",
            "--goodput", f"ttft:{1e3 * a.slo_ttft:g}", f"tpot:{1e3 * a.slo_tpot:g}",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(out), "--result-filename", name, "--disable-tqdm"]


def serve_cmd(a: argparse.Namespace, strategy: str, n: int, port: int, mock_profile: Path | None) -> list[str]:
    cmd = [*CLI, "serve", "--strategy", strategy, "--num-instances", str(n), "--num-threads", "1",
           "--port", str(port), "--slo-ttft", str(a.slo_ttft), "--slo-tpot", str(a.slo_tpot),
           "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
           "--chunk-size", str(a.max_num_batched_tokens), "--uvicorn-log-level", "warning"]
    if strategy in FUDG:
        cmd += ["--pd", f"{n // 2}:{n - n // 2}"]
    if mock_profile is not None:
        cmd += ["--mock-profile", str(mock_profile)]
    return cmd


def run_server(a: argparse.Namespace, strategy: str, n: int, rates: list[float], num_prompts: int, out: Path,
               mock_profile: Path | None = None) -> tuple[list[dict], list[dict]]:
    """Start the cluster once, run the bench at each rate; returns the bench results and /cluster at the end."""
    port = free_port()
    tag = f"{'mock' if mock_profile else 'real'}_{strategy}"
    log = open(out / f"{tag}.server.log", "w")
    server = subprocess.Popen(serve_cmd(a, strategy, n, port, mock_profile), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    results = []
    try:
        wait_ready(port, server, path="/health")
        for rate in rates:
            name = f"{tag}_rate{rate:g}.json"
            subprocess.run([*CLI, "bench", "serve", *bench_args(a, port, rate, num_prompts, out, name)],
                           check=True, stdout=subprocess.DEVNULL, timeout=1800)
            results.append(json.loads((out / name).read_text()))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/cluster", timeout=10) as r:
            cluster = json.loads(r.read())["instances"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
    return results, cluster


def summarize(res: dict, num_prompts: int) -> dict:
    good = (res["request_goodput"] or 0.0) * res["duration"]
    return {"rate": res["request_rate"], "completed": res["completed"], "goodput_rps": res["request_goodput"],
            "slo_attainment": good / num_prompts, "throughput_rps": res["request_throughput"],
            **{k: res[k] for k in ("mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p90_tpot_ms")}}


def workload(a: argparse.Namespace, rate: float, num_prompts: int):
    """The bench's own requests and send times, rebuilt with its code and seed."""
    from ecoserve.bench.datasets import load_tokenizer, sample_requests
    from ecoserve.bench.serve import add_cli_args, arrival_times
    from ecoserve.sim.workload import SimRequest

    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args(bench_args(a, 0, rate, num_prompts, Path("unused"), "unused"))
    reqs = sample_requests(args, load_tokenizer(a.model_dir), as_text=False)
    times = arrival_times(len(reqs), args.request_rate, args.burstiness, np.random.default_rng(args.seed))
    return [SimRequest(f"r{i}", float(t), r.prompt_len, r.expected_output_len) for i, (r, t) in enumerate(zip(reqs, times))]


def simulate(a: argparse.Namespace, strategy: str, n: int, profile: Path, rate: float, num_prompts: int) -> dict:
    from ecoserve.sim.cluster import ClusterSpec, build

    spec = ClusterSpec(model=a.model_dir, gpu="L20", tp=1, num_instances=n, profile=str(profile),
                       max_num_batched_tokens=a.max_num_batched_tokens, chunk_size=a.max_num_batched_tokens,
                       max_num_seqs=a.max_num_seqs, perf_knobs={"kv_bytes_per_token": 0.0})
    options = {"pd": (n // 2, n - n // 2)} if strategy in FUDG else {}
    res = build(strategy, spec, ttft_slo=a.slo_ttft, tpot_slo=a.slo_tpot, **options).run(workload(a, rate, num_prompts))
    ttft = np.array([r.first_token - r.arrival for r in res.records])
    tpot = np.array([(r.finish - r.first_token) / (r.output_len - 1) for r in res.records if r.output_len > 1])
    return {"mean_ttft_ms": 1e3 * ttft.mean(), "p90_ttft_ms": 1e3 * np.percentile(ttft, 90),
            "mean_tpot_ms": 1e3 * tpot.mean(), "p90_tpot_ms": 1e3 * np.percentile(tpot, 90),
            "completed": len(res.records), "instances": res.extra["instances"]}


def compare(live: dict, cluster: list[dict], sim: dict) -> dict:
    """Routing: each instance's share of dispatches (and windows); latency: absolute percentage errors."""
    keys = ("mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p90_tpot_ms")
    ape = {k: abs(sim[k] - live[k]) / live[k] for k in keys}
    sent = [c["num_dispatched"] for c in cluster]
    live_share = [s / max(sum(sent), 1) for s in sent]
    sim_share = [i["routed_fraction"] for i in sim["instances"]]
    return {"live": {k: live[k] for k in keys}, "sim": {k: sim[k] for k in keys}, "ape": ape,
            "mape": sum(ape.values()) / len(ape), "live_share": live_share, "sim_share": sim_share,
            "share_tvd": 0.5 * sum(abs(x - y) for x, y in zip(live_share, sim_share)),
            "live_windows": [c["num_windows"] for c in cluster],
            "sim_windows": [i["num_windows"] for i in sim["instances"]],
            "completed": {"live": live["completed"], "sim": sim["completed"]}}


def plot(real: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for strategy, rows in real.items():
        rates = [r["rate"] for r in rows]
        ax1.plot(rates, [r["goodput_rps"] for r in rows], marker="o", label=strategy)
        ax2.plot(rates, [100 * r["slo_attainment"] for r in rows], marker="o", label=strategy)
    ax1.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)")
    ax2.set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    ax1.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/cluster")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--rates", default="0.25,0.5,1", help="request rates (req/s) on the 2 real instances")
    p.add_argument("--num-prompts", type=int, default=12, help="per rate, real instances")
    p.add_argument("--mock-instances", type=int, default=8)
    p.add_argument("--mock-rate", type=float, default=2.0)
    p.add_argument("--mock-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.25, help="seconds")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, help="a tokens,ms CSV for the mock part (default: measure one)")
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--skip-mock", action="store_true")
    p.add_argument("--figure", default=None, help="the PNG (default OUT/live_cluster.png)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from ecoserve.model.default import default_model_dir
    a.model_dir = str(default_model_dir())
    strategies = [s for s in a.strategies.split(",") if s]
    rates = [float(r) for r in a.rates.split(",")]
    report: dict = {"args": vars(a), "load_avg_start": os.getloadavg(), "real": {}, "mock": {}}
    path = out / "bench_cluster.json"

    if not a.skip_real:
        for s in strategies:
            t0 = time.monotonic()
            results, _ = run_server(a, s, 2, rates, a.num_prompts, out)
            report["real"][s] = [summarize(r, a.num_prompts) for r in results]
            print(f"real {s}: {time.monotonic() - t0:.0f} s", flush=True)
            path.write_text(json.dumps(report, indent=1))
        print("\n| strategy | rate (req/s) | completed | goodput (req/s) | SLO attainment | mean TTFT (ms) "
              "| p90 TTFT (ms) | mean TPOT (ms) | p90 TPOT (ms) |\n|---|---|---|---|---|---|---|---|---|")
        for s, rows in report["real"].items():
            for r in rows:
                print(f"| {s} | {r['rate']:g} | {r['completed']}/{a.num_prompts} | {r['goodput_rps']:.3f} | "
                      f"{100 * r['slo_attainment']:.0f}% | {r['mean_ttft_ms']:.0f} | {r['p90_ttft_ms']:.0f} | "
                      f"{r['mean_tpot_ms']:.0f} | {r['p90_tpot_ms']:.0f} |")
        plot(report["real"], Path(a.figure or out / "live_cluster.png"),
             f"2 x SmolLM2-135M instances, 1 torch thread each, shared 2-core CPU; SLO TTFT {a.slo_ttft:g} s, "
             f"TPOT {1e3 * a.slo_tpot:g} ms; {a.num_prompts} prompts per rate")

    if not a.skip_mock:
        profile = Path(a.profile) if a.profile else out / "profile.csv"
        if not a.profile:
            measure_profile(None, 1, profile, reps=3)
        report["profile"] = profile.read_text()
        for s in strategies:
            results, cluster = run_server(a, s, a.mock_instances, [a.mock_rate], a.mock_prompts, out, profile)
            sim = simulate(a, s, a.mock_instances, profile, a.mock_rate, a.mock_prompts)
            report["mock"][s] = compare(results[0], cluster, sim)
            path.write_text(json.dumps(report, indent=1))
        print(f"\n{a.mock_instances} mock instances vs the simulator, {a.mock_prompts} prompts at {a.mock_rate:g} req/s\n"
              "| strategy | TTFT mean live/sim (ms) | TTFT p90 live/sim | TPOT mean live/sim | TPOT p90 live/sim "
              "| MAPE | dispatch share TVD | windows live / sim |\n|---|---|---|---|---|---|---|---|")
        for s, c in report["mock"].items():
            lv, sm = c["live"], c["sim"]
            cells = " | ".join(f"{lv[k]:.0f} / {sm[k]:.0f}" for k in lv)
            win = (f"{sum(c['live_windows'])} / {sum(c['sim_windows'])}" if c["sim_windows"][0] is not None else "-")
            print(f"| {s} | {cells} | {100 * c['mape']:.1f}% | {c['share_tvd']:.3f} | {win} |")
    report["load_avg_end"] = os.getloadavg()
    path.write_text(json.dumps(report, indent=1))
    print(f"\nwritten {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
