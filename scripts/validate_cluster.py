"""The simulator checked against a live cluster of real instances, every strategy on one trace.

1. Profile (unless --profile): `scripts/profile_steps.sh default cpu float32` times the embedded
   SmolLM2's prefill, decode and hybrid steps on this machine (one torch thread) -> OUT/profile/steps.csv.
2. Live: for each strategy, `ecoserve serve --strategy S --num-instances 2 --num-threads 1` (FuDG with
   --pd 1:1, ecoserve with `temporal` instances and the `paper` router mode, the serve default),
   loaded by `ecoserve bench serve` in its own process (scripts/bench_cluster.py's code).
3. Simulated: the same requests and send times (the bench's dataset and arrival code and seed) on
   the simulator with `ClusterSpec(profile=steps.csv)` (`StepProfilePerf`).
4. Both sides with one definition: TTFT = first streamed token (the simulator's
   `RequestRecord.ttft_first_token`), TPOT = (e2e - TTFT) / (output - 1) as the bench computes it,
   SLO attainment = both SLOs met over all prompts sent. Prints and writes OUT/validate_cluster.json:
   per strategy live vs simulated TTFT and TPOT p50/p90 and attainment, absolute percentage errors,
   MAPE per metric and per strategy.

    nice -n 0 python scripts/validate_cluster.py --out results/validate_cluster --profile-after --profile-copies 2  # ~12 min
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_cluster import FUDG, STRATEGIES, run_server, workload  # noqa: E402 (a script beside this one)

METRIC_KEYS = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "p90_tpot_ms", "slo_attainment")


def latency_metrics(ttft_s, latency_s, output_lens, num_sent: int, slo_ttft: float, slo_tpot: float) -> dict:
    """TTFT / TPOT percentiles of the finished requests and SLO attainment over all sent, as the bench
    computes them: TPOT = (latency - TTFT) / (output - 1); a one-token request meets any TPOT SLO."""
    ttft = np.asarray(ttft_s, dtype=float)
    lat = np.asarray(latency_s, dtype=float)
    n = np.asarray(output_lens, dtype=int)
    if not len(ttft):
        raise ValueError("no finished request to measure")
    multi = n > 1
    tpot = np.where(multi, (lat - ttft) / np.maximum(n - 1, 1), 0.0)
    good = int(np.sum((ttft <= slo_ttft) & (tpot <= slo_tpot)))
    pct = lambda v, q: 1e3 * float(np.percentile(v, q)) if len(v) else float("nan")  # noqa: E731
    return {"p50_ttft_ms": pct(ttft, 50), "p90_ttft_ms": pct(ttft, 90),
            "p50_tpot_ms": pct(tpot[multi], 50), "p90_tpot_ms": pct(tpot[multi], 90),
            "slo_attainment": good / num_sent, "completed": len(ttft), "sent": num_sent}


def live_metrics(res: dict, a: argparse.Namespace) -> dict:
    """From the bench's saved per-request lists (failed requests count as misses)."""
    ok = [not e for e in res["errors"]]
    pick = lambda key: [v for v, k in zip(res[key], ok) if k]  # noqa: E731
    return latency_metrics(pick("ttfts"), pick("latencies"), pick("output_lens"), len(ok), a.slo_ttft, a.slo_tpot)


def sim_metrics(records, num_submitted: int, a: argparse.Namespace) -> dict:
    ttft = [r.ttft_first_token for r in records]
    return latency_metrics(ttft, [r.finish - r.arrival for r in records], [r.output_len for r in records],
                           num_submitted, a.slo_ttft, a.slo_tpot)


def simulate(a: argparse.Namespace, strategy: str, profile: Path) -> dict:
    from ecoserve.sim.cluster import ClusterSpec, build

    spec = ClusterSpec(model=a.model_dir, gpu="L20", tp=1, num_instances=a.num_instances, profile=str(profile),
                       max_num_batched_tokens=a.max_num_batched_tokens, chunk_size=a.max_num_batched_tokens,
                       max_num_seqs=a.max_num_seqs)
    n = a.num_instances
    options = {"pd": (n // 2, n - n // 2)} if strategy in FUDG else {}
    if strategy == "ecoserve":
        options["router_mode"] = a.router_mode
    res = build(strategy, spec, ttft_slo=a.slo_ttft, tpot_slo=a.slo_tpot, **options).run(
        workload(a, a.rate, a.num_prompts))
    return sim_metrics(res.records, res.num_submitted, a)


def ape(live: float, sim: float) -> float | None:
    """|sim - live| / live; None where live is 0 (no relative error defined)."""
    return abs(sim - live) / abs(live) if live else None


def compare(live: dict, sim: dict) -> dict:
    errors = {k: ape(live[k], sim[k]) for k in METRIC_KEYS}
    defined = [e for e in errors.values() if e is not None]
    return {"live": live, "sim": sim, "ape": errors, "mape": sum(defined) / len(defined) if defined else None}


def summary(per_strategy: dict[str, dict]) -> dict:
    """MAPE per metric (over strategies) and overall (over every defined error)."""
    per_metric = {}
    for k in METRIC_KEYS:
        errs = [c["ape"][k] for c in per_strategy.values() if c["ape"][k] is not None]
        per_metric[k] = sum(errs) / len(errs) if errs else None
    every = [e for c in per_strategy.values() for e in c["ape"].values() if e is not None]
    return {"mape_per_metric": per_metric, "mape_all": sum(every) / len(every) if every else None}


def markdown(per_strategy: dict[str, dict], summ: dict) -> str:
    pc = lambda e: "-" if e is None else f"{100 * e:.1f}%"  # noqa: E731
    head = ("| strategy | TTFT p50 live / sim (ms) | TTFT p90 | TPOT p50 | TPOT p90 | SLO attainment | MAPE |\n"
            "|---|---|---|---|---|---|---|")
    lines = [head]
    for s, c in per_strategy.items():
        lv, sm, er = c["live"], c["sim"], c["ape"]
        cells = [f"{lv[k]:.0f} / {sm[k]:.0f} ({pc(er[k])})" for k in METRIC_KEYS[:4]]
        cells.append(f"{100 * lv['slo_attainment']:.0f}% / {100 * sm['slo_attainment']:.0f}% ({pc(er['slo_attainment'])})")
        lines.append(f"| {s} | {' | '.join(cells)} | {pc(c['mape'])} |")
    m = summ["mape_per_metric"]
    lines.append(f"| **MAPE per metric** | {' | '.join(f'**{pc(m[k])}**' for k in METRIC_KEYS)} | **{pc(summ['mape_all'])}** |")
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "unknown")


def measure_profile(out: Path, copies: int = 1) -> Path:
    """`copies` profiles at once (as many as live instances: each instance shares the CPU with the
    others, as in the live cluster), averaged row by row into OUT/steps.csv."""
    script = str(Path(__file__).parent / "profile_steps.sh")
    dirs = [out / f"copy{i}" for i in range(copies)] if copies > 1 else [out]
    procs = [subprocess.Popen([script, "default", "cpu", "float32"], env={**os.environ, "PY": sys.executable,
                                                                          "OUT": str(d)}) for d in dirs]
    if any(pr.wait() for pr in procs):
        raise RuntimeError("a step profile failed; see its output above")
    if copies > 1:
        return mean_profile([d / "steps.csv" for d in dirs], out / "steps.csv")
    return out / "steps.csv"


def mean_profile(paths: list[Path], out: Path) -> Path:
    """The row-by-row mean of step profiles measured on one grid (before and after the live runs: the
    machine's load drifts, the mean stands for the conditions in between)."""
    tables = [p.read_text().splitlines() for p in paths]
    keys = [[ln.rsplit(",", 1)[0] for ln in t] for t in tables]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"profiles {paths} are not on one grid")
    rows = [keys[0][i] + "," + f"{np.mean([float(t[i].rsplit(',', 1)[1]) for t in tables]):.3f}"
            for i in range(1, len(keys[0]))]
    out.write_text("\n".join([tables[0][0], *rows]) + "\n")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/validate_cluster")
    p.add_argument("--strategies", default="vllm,sarathi,distserve,mooncake,ecoserve")
    p.add_argument("--profile", default=None, help="a steps.csv of scripts/profile_steps.py (default: measure one)")
    p.add_argument("--num-instances", type=int, default=2)
    p.add_argument("--rate", type=float, default=1.0, help="request rate (req/s)")
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--slo-ttft", type=float, default=0.3, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.07, help="seconds")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--router-mode", default="paper", help="ecoserve in the simulator (live: the serve default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-live", action="store_true", help="reuse OUT/real_S_rateR.json from an earlier run")
    p.add_argument("--profile-copies", type=int, default=1,
                   help="profiles measured at once (2: each shares the CPU with another, as the live instances do)")
    p.add_argument("--profile-after", action="store_true",
                   help="measure a second profile after the live runs and simulate with the mean of both")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from ecoserve.model.default import default_model_dir
    a.model_dir = str(default_model_dir())
    strategies = [s for s in a.strategies.split(",") if s]
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        raise SystemExit(f"unknown strategies {sorted(unknown)}; known: {', '.join(STRATEGIES)}")
    report: dict = {"args": vars(a), "cpu": cpu_model(), "nproc": os.cpu_count(), "load_avg_start": os.getloadavg(),
                    "strategies": {}, "errors": {}, "load_avg": {}}
    path = out / "validate_cluster.json"
    profile = Path(a.profile) if a.profile else out / "profile" / "steps.csv"
    if not a.profile and not (a.skip_live and profile.exists()):
        measure_profile(out / "profile", a.profile_copies)
    report["profile"] = str(profile)
    report["load_avg"]["after_profile"] = os.getloadavg()
    lives: dict[str, dict] = {}
    for s in strategies:
        name = out / f"real_{s}_rate{a.rate:g}.json"
        try:
            if not a.skip_live:
                t0 = time.monotonic()
                report["load_avg"][f"{s}_before"] = os.getloadavg()
                run_server(a, s, a.num_instances, [a.rate], a.num_prompts, out)
                print(f"live {s}: {time.monotonic() - t0:.0f} s", flush=True)
                report["load_avg"][f"{s}_after"] = os.getloadavg()
            lives[s] = live_metrics(json.loads(name.read_text()), a)
        except (subprocess.SubprocessError, RuntimeError, OSError, ValueError) as e:
            report["errors"][s] = f"{type(e).__name__}: {e}"
            print(f"live {s} failed: {e} (see {out}/real_{s}.server.log)", flush=True)
        path.write_text(json.dumps(report, indent=1))
    if a.profile_after:
        after = out / "profile_after" / "steps.csv"
        if not (a.skip_live and after.exists()):
            measure_profile(out / "profile_after", a.profile_copies)
        report["load_avg"]["after_profile_after"] = os.getloadavg()
        profile = mean_profile([profile, after], out / "steps_mean.csv")
        report["profile"] = str(profile)
    for s, live in lives.items():
        report["strategies"][s] = compare(live, simulate(a, s, profile))
    report["summary"] = summary(report["strategies"])
    report["load_avg_end"] = os.getloadavg()
    path.write_text(json.dumps(report, indent=1))
    print(f"\n{a.num_instances} real instances vs the simulator: {a.num_prompts} prompts at {a.rate:g} req/s, "
          f"SLO TTFT {a.slo_ttft:g} s, TPOT {1e3 * a.slo_tpot:g} ms; profile {profile}")
    print(markdown(report["strategies"], report["summary"]))
    print(f"\nCPU {report['cpu']}, load {report['load_avg_start']} -> {report['load_avg_end']}; written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
