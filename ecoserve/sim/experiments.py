"""Named experiments reproducing EcoServe's evaluation in simulation; each writes JSON and a PNG.

Every point is a whole simulation through the live scheduler and the cluster controllers. Sizes
are kept small by default (a few hundred requests per rate point) so that runs finish on a laptop;
raise `num_requests` for tighter numbers. A *series* is a strategy with options: `ecoserve` is the
paper-mode router, `ecoserve_ref` the authors' released scheduler (reference mode), `ecoserve_strict`
the paper's Algorithm 1 as written (paper-strict mode).

Goodput comes from attainment curves (`goodput_curve`): one curve per series and cell on a geometric
grid of rates gives P90 and P99 goodput, each in two definitions (metrics.goodput_from_curve).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from ecoserve.sim.cluster import ClusterSpec
from ecoserve.sim.metrics import (GOODPUT_DEFINITIONS, GOODPUT_TARGETS, TARGETS, CurveConfig, CurvePoint, attainment,
                                  attainment_curve, goodputs, summarize)
from ecoserve.sim.models import model as get_model
from ecoserve.registry import Registry
from ecoserve.sim.cluster import build
from ecoserve.sim.workload import DATASETS, rate_schedule, synthetic

EXPERIMENTS: Registry = Registry("experiment")
PAPER_TP = {"llama-30b": 4, "codellama-34b": 4, "qwen2-72b": 8}
MOONCAKE_PD = [(3, 5), (5, 3)]
SERIES = {"vllm": ("vllm", {}), "sarathi": ("sarathi", {}), "distserve": ("distserve", {}),
          "mooncake": ("mooncake", {}), "ecoserve": ("ecoserve", {"router_mode": "paper"}),
          "ecoserve_ref": ("ecoserve", {"router_mode": "reference"}),
          "ecoserve_strict": ("ecoserve", {"router_mode": "paper-strict"})}
ALL = ("vllm", "sarathi", "distserve", "mooncake", "ecoserve", "ecoserve_ref", "ecoserve_strict")
ECO = ("ecoserve", "ecoserve_ref", "ecoserve_strict")
ARRIVAL_S = 45.0  # default seconds of arrivals per rate point (`ecoserve simulate ... --duration`)


def l20_spec(model: str, num_instances: int = 8, **kw) -> ClusterSpec:
    """The paper's primary cluster: one instance per L20 node, 10 GbE between nodes."""
    return ClusterSpec(model=model, gpu="L20", tp=PAPER_TP.get(model, 4), num_instances=num_instances,
                       network="10gbe", **kw)


# Curve start rates per instance, about a quarter of the lowest series' P90 capacity on the L20 cluster
# (results/sim/ov_*/overall.json), so that a dip below capacity is on the grid.
START_PER_INSTANCE = {"alpaca": 2.0, "sharegpt": 1.0, "longbench": 0.1}
CURVE = CurveConfig()  # the grid of every goodput curve (`ecoserve simulate ... --grid-ratio`)


def attain_at(strategy: str, spec: ClusterSpec, dataset: str, rate: float, ttft: float, tpot: float,
              num_requests: int, seed: int = 0, arrival: str = "poisson", cv: float = 1.0,
              duration: float | None = None, **kw) -> CurvePoint:
    """Attainment at `rate`: arrivals over at least `duration` seconds (so queues reach steady
    state; short bursts are absorbed by memory and flatter every strategy), at least `num_requests`."""
    n = int(min(max(num_requests, rate * (duration or ARRIVAL_S)), 12_000))
    wl = synthetic(dataset, rate, n, seed=seed, arrival=arrival, cv=cv,
                   max_model_len=get_model(spec.model).max_model_len)
    res = build(strategy, spec, ttft, tpot, **kw).run(wl, horizon=max(60.0, 10 * ttft))
    summary = summarize(res.records, ttft, tpot, res.num_submitted)
    return CurvePoint(rate, attainment(res.records, ttft, tpot, res.num_submitted),
                      summary.get("ttft", {}).get("p90"), summary.get("tpot", {}).get("p90"))


def goodput_curve(strategy: str, spec: ClusterSpec, dataset: str, num_requests: int = 400,
                  ttft: float | None = None, tpot: float | None = None, seed: int = 0,
                  start: float | None = None, **kw) -> dict:
    """One attainment curve on the grid `CURVE` and, from it, goodput for P90 and P99 in both definitions.

    Returns {"goodput": {target: {"monotone", "max"}}, "per_gpu": the same / GPUs, "points": [...]}.
    """
    ds = DATASETS.get(dataset)
    ttft, tpot = ttft or ds.ttft_slo, tpot or ds.tpot_slo
    fn = lambda r: attain_at(strategy, spec, dataset, r, ttft, tpot, num_requests, seed, **kw)
    points = attainment_curve(fn, start or START_PER_INSTANCE[dataset] * spec.num_instances, CURVE)
    g = goodputs(points)
    return {"goodput": g, "per_gpu": {t: {d: v / spec.num_gpus for d, v in by.items()} for t, by in g.items()},
            "points": [asdict(p) for p in points]}


def _best_mooncake(spec, dataset, **kw) -> dict:
    """Both P:D splits' curves; the best split is chosen separately for each target and definition."""
    curves = {}
    for pd in MOONCAKE_PD:
        if pd[0] + pd[1] != spec.num_instances:
            pd = (max(1, round(spec.num_instances * pd[0] / 8)), 0)
            pd = (pd[0], spec.num_instances - pd[0])
        if f"{pd[0]}:{pd[1]}" in curves:
            continue  # small clusters map both splits to the same one
        curves[f"{pd[0]}:{pd[1]}"] = {**goodput_curve("mooncake", spec, dataset, pd=pd, **kw), "pd": list(pd)}
    best: dict = {"goodput": {}, "per_gpu": {}, "pd": {}}
    for t in GOODPUT_TARGETS:
        for key in ("goodput", "per_gpu", "pd"):
            best[key][t] = {}
        for d in GOODPUT_DEFINITIONS:
            top = max(curves.values(), key=lambda c: c["goodput"][t][d])
            best["goodput"][t][d], best["per_gpu"][t][d] = top["goodput"][t][d], top["per_gpu"][t][d]
            best["pd"][t][d] = top["pd"]
    return {**best, "curves": curves}


def _goodput_any(series, spec, dataset, **kw) -> dict:
    """A series' goodput result (mooncake: the best P:D per target and definition, with each split's curve)."""
    strategy, opts = SERIES[series]
    if strategy == "mooncake":
        return _best_mooncake(spec, dataset, **kw)
    return goodput_curve(strategy, spec, dataset, **{**opts, **kw})


def _curves(r: dict) -> dict[str, list[dict]]:
    """A result's curves by label: one, or one per MoonCake split."""
    return {k: c["points"] for k, c in r["curves"].items()} if "curves" in r else {"": r["points"]}


def _g(r: dict, target: str = "p90", definition: str = "monotone") -> float:
    return r["goodput"][target][definition]


def _by_definition(fn) -> dict:
    """{target: {definition: fn(target, definition)}} over the reported targets and both definitions."""
    return {t: {d: fn(t, d) for d in GOODPUT_DEFINITIONS} for t in GOODPUT_TARGETS}


def _save(out: Path, name: str, data: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    p = out / f"{name}.json"
    p.write_text(json.dumps(data, indent=1, default=str))
    return p


def _bar_plot(out: Path, name: str, groups: dict[str, dict[str, float]], ylabel: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    keys = list(groups)
    series = sorted({s for g in groups.values() for s in g})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(keys)), 3.5))
    w = 0.8 / max(len(series), 1)
    for k, s in enumerate(series):
        ax.bar(np.arange(len(keys)) + k * w, [groups[g].get(s, 0) for g in keys], w, label=s)
    ax.set_xticks(np.arange(len(keys)) + 0.4 - w / 2, keys, rotation=20, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)


def _timed(series, spec, dataset, **kw) -> dict:
    t0 = time.process_time()
    r = _goodput_any(series, spec, dataset, **kw)
    r["cpu_s"] = round(time.process_time() - t0, 1)
    return r


def _line(label: str, r: dict) -> str:
    n = sum(len(c) for c in _curves(r).values())
    return (f"{label:40s} P90 {_g(r, 'p90'):7.2f} / {_g(r, 'p90', 'max'):7.2f}  P99 {_g(r, 'p99'):7.2f} / "
            f"{_g(r, 'p99', 'max'):7.2f} req/s (monotone / max; {n} points, {r['cpu_s']:.0f} s CPU)")


def _grid() -> dict:
    """How the curves were sampled (also marks a goodput JSON as made from curves)."""
    return {"arrival_s": ARRIVAL_S, "curve": asdict(CURVE), "start_per_instance": START_PER_INSTANCE}


def _compact(results: dict) -> dict:
    """{row: {column: {target: {definition: goodput}}}} from the full results (curves left out)."""
    return {k: {c: r["goodput"] for c, r in row.items()} for k, row in results.items()}


@EXPERIMENTS.register("overall")
def overall(out: Path, models=("llama-30b", "codellama-34b", "qwen2-72b"), datasets=("alpaca", "sharegpt", "longbench"),
            strategies=ALL, num_requests=400) -> dict:
    """Figs. 8-9: every series' attainment curve per cell on the L20 cluster (8 instances, 10 GbE), with P90
    and P99 goodput in both definitions, and one PNG of the curves per cell under `out/curves/`."""
    res: dict = {}
    for m in models:
        for d in datasets:
            key = f"{m}/{d}"
            res[key] = {}
            for s in strategies:
                if s == "distserve" and PAPER_TP.get(m) == 8:
                    continue  # the paper: DistServe cannot place 72B at TP=8 twice in one node
                res[key][s] = _timed(s, l20_spec(m), d, num_requests=num_requests)
                print(_line(f"{key} {s}", res[key][s]), flush=True)
            plot_curves(out / "curves", key, res[key])
    ratios = {e: {s: _by_definition(lambda t, df, e=e, s=s: _mean_ratio(res, e, s, t, df))
                  for s in strategies if s not in ECO} for e in ECO if e in strategies}
    data = {"num_requests": num_requests, **_grid(), "goodput": _compact(res), "results": res, "ecoserve_over": ratios}
    _save(out, "overall", data)
    _bar_plot(out, "overall", {k: {s: _g(v) for s, v in r.items()} for k, r in res.items()}, "P90 goodput (req/s), monotone")
    plot_overall_vs_vllm(out, data)
    return data


def _mean_ratio(res: dict, e: str, s: str, target: str, definition: str) -> float | None:
    """Mean over cells of EcoServe's goodput over baseline `s`'s (cells where the baseline's is 0 left out)."""
    vals = [_g(r[e], target, definition) / _g(r[s], target, definition) for r in res.values()
            if e in r and s in r and _g(r[s], target, definition) > 0]
    return sum(vals) / len(vals) if vals else None


def plot_overall_vs_vllm(out: Path, data: dict) -> None:
    """The overall figure normalised to vLLM per cell, so LongBench's small rates stay readable."""
    groups = {k: {s: v["p90"]["monotone"] / r["vllm"]["p90"]["monotone"] for s, v in r.items()}
              for k, r in data["goodput"].items() if r.get("vllm", {}).get("p90", {}).get("monotone")}
    _bar_plot(out, "overall_vs_vllm", groups, "P90 goodput / vLLM's (monotone)")


def plot_curves(out: Path, key: str, cell: dict) -> Path:
    """Attainment against rate (log x) for every series of one cell, with the P90 and P99 lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for s, r in cell.items():
        for label, pts in _curves(r).items():
            ax.semilogx([p["rate"] for p in pts], [p["attainment"] for p in pts], "o-", ms=3,
                        label=f"{s} {label}".strip())
    for t, ls in (("p90", "--"), ("p99", ":")):
        ax.axhline(TARGETS[t], color="gray", ls=ls, lw=0.8, label=f"{t.upper()} ({TARGETS[t]:g})")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(key, fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    path = out / f"{key.replace('/', '_')}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _drops(goodput: dict) -> dict:
    """Per row: the relative drop from the first column to the last, per target and definition."""
    def drop(v, t, d):
        first, last = v[list(v)[0]][t][d], v[list(v)[-1]][t][d]
        return 1 - last / first if first else None
    return {s: _by_definition(lambda t, d, v=v: drop(v, t, d)) for s, v in goodput.items()}


@EXPERIMENTS.register("slo")
def slo_sensitivity(out: Path, model="codellama-34b", dataset="sharegpt", num_requests=400,
                    strategies=ALL) -> dict:
    """Fig. 10: goodput (the paper: P99) as the SLOs tighten (paper: A800; here the L20 cluster)."""
    slos = [(5, 0.1), (3, 0.08), (3, 0.05), (1, 0.08), (1, 0.05)]
    res = {}
    for s in strategies:
        res[s] = {}
        for a, b in slos:
            label = f"{a}s/{int(b * 1000)}ms"
            res[s][label] = _timed(s, l20_spec(model), dataset, ttft=a, tpot=b, num_requests=num_requests)
            print(_line(f"{label} {s}", res[s][label]), flush=True)
    g = _compact(res)
    data = {"model": model, "dataset": dataset, **_grid(), "goodput": g, "results": res, "drop_loosest_to_strictest": _drops(g)}
    _save(out, "slo", data)
    _bar_plot(out, "slo", {c: {s: g[s][c]["p99"]["monotone"] for s in g} for c in next(iter(g.values()))},
              "P99 goodput (req/s), monotone")
    return data


@EXPERIMENTS.register("burstiness")
def burstiness(out: Path, model="codellama-34b", dataset="sharegpt", num_requests=400,
               strategies=ALL) -> dict:
    """Fig. 11: goodput (the paper: P99) under Gamma arrivals with CV 1.2 -> 2.0 (same mean rate)."""
    cvs = [1.2, 1.5, 2.0]
    res = {}
    for s in strategies:
        res[s] = {}
        for cv in cvs:
            res[s][str(cv)] = _timed(s, l20_spec(model), dataset, arrival="gamma", cv=cv, num_requests=num_requests)
            print(_line(f"CV {cv} {s}", res[s][str(cv)]), flush=True)
    g = _compact(res)
    data = {"model": model, "dataset": dataset, **_grid(), "goodput": g, "results": res, "drop_cv1.2_to_2.0": _drops(g)}
    _save(out, "burstiness", data)
    _bar_plot(out, "burstiness", {f"CV {cv}": {s: g[s][str(cv)]["p99"]["monotone"] for s in g} for cv in cvs},
              "P99 goodput (req/s), monotone")
    return data


@EXPERIMENTS.register("scaling")
def static_scaling(out: Path, models=("codellama-34b", "qwen2-72b"), dataset="sharegpt", num_requests=400,
                   strategies=ECO, sizes=(1, 2, 3, 4)) -> dict:
    """Fig. 12: EcoServe goodput with 1..4 instances in one macro instance (each router mode)."""
    res = {}
    for m in models:
        for e in strategies:
            res[f"{m}/{e}"] = {}
            for n in sizes:
                res[f"{m}/{e}"][n] = _timed(e, l20_spec(m, n), dataset, num_requests=num_requests)
                print(_line(f"{m} {e} {n} instances", res[f"{m}/{e}"][n]), flush=True)
    g = _compact(res)
    ratio = {k: _by_definition(lambda t, d, v=v: v[sizes[-1]][t][d] / v[sizes[0]][t][d] if v[sizes[0]][t][d] else None)
             for k, v in g.items()}
    data = {"dataset": dataset, **_grid(), "goodput": g, "results": res, f"scale_{sizes[0]}_to_{sizes[-1]}": ratio}
    _save(out, "scaling", data)
    _bar_plot(out, "scaling", {f"{n} inst": {k: g[k][n]["p90"]["monotone"] for k in g} for n in sizes},
              "P90 goodput (req/s), monotone")
    return data


@EXPERIMENTS.register("mitosis")
def dynamic_mitosis(out: Path, model="codellama-34b", dataset="sharegpt", step_s=120.0, window_s=30.0,
                    strategies=ECO) -> dict:
    """Fig. 13: rate 20 -> 50 req/s in steps of `step_s`; mitosis from 8 instances up to 16 (N_l=6, N_u=11)."""
    rates = [20, 25, 30, 35, 40, 45, 50]
    wl = rate_schedule(dataset, [(r, step_s) for r in rates], seed=0)
    ds = DATASETS.get(dataset)
    data = {"model": model, "step_s": step_s, "series": {}}
    for e in strategies:
        sim = build("ecoserve", l20_spec(model), ds.ttft_slo, ds.tpot_slo, total_instances=16, macro_sizes=[8],
                    mitosis=dict(n_lower=6, n_upper=11, cooldown_s=15.0), mitosis_period=5.0, **SERIES[e][1])
        res = sim.run(wl, horizon=60.0, progress=False)
        end = step_s * len(rates)
        series = []
        for k in range(int(end // window_s)):
            a, b = k * window_s, (k + 1) * window_s
            recs = [r for r in res.records if a <= r.arrival < b]
            sub = sum(1 for r in wl if a <= r.arrival_time < b)
            tl = [t for t in res.extra["timeline"] if t["time"] <= b]
            series.append({"t": b, "rate": rates[min(int(a // step_s), len(rates) - 1)],
                           "attainment": attainment(recs, ds.ttft_slo, ds.tpot_slo, sub),
                           "instances": tl[-1]["active"] if tl else 8, "sizes": tl[-1]["sizes"] if tl else [8]})
        data["series"][e] = series
    _save(out, "mitosis", data)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax2 = ax.twinx()
    for e, series in data["series"].items():
        ts = [s["t"] for s in series]
        ax.plot(ts, [s["attainment"] for s in series], "o-", label=f"attainment {e}")
        ax2.step(ts, [s["instances"] for s in series], "--", where="post", label=f"instances {e}")
    ax.legend(fontsize=7)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("SLO attainment")
    ax2.set_ylabel("instances")
    fig.tight_layout()
    fig.savefig(out / "mitosis.png", dpi=120)
    plt.close(fig)
    return data


@EXPERIMENTS.register("ablation")
def ablations(out: Path, models=("codellama-34b",), dataset="sharegpt", num_requests=400,
              fixed=(0.25, 0.5, 0.75, 1.0)) -> dict:
    """Figs. 15-16: cyclic vs random order; Algorithm 1 vs fixed-interval routing; slack rules; hold."""
    # name -> (router mode, more RouterConfig fields)
    variants = {"paper": ("paper", {}), "reference": ("reference", {}), "random_order": ("paper", {"order": "random"}),
                "min_slack": ("paper", {"slack": "min"}), "phase_slack": ("paper", {"slack": "phase"}),
                "paper_hold": ("paper", {"output_hold": True}),
                "reference_no_hold": ("reference", {"output_hold": False}),
                **{f"fixed_{f}": ("fixed_interval", {"interval_frac": f}) for f in fixed}}
    res = {}
    for m in models:
        res[m] = {}
        for v, (mode, kw) in variants.items():
            res[m][v] = _timed("ecoserve", l20_spec(m), dataset, num_requests=num_requests, router_mode=mode, router=kw)
            print(_line(f"{m} {v}", res[m][v]), flush=True)
    g = _compact(res)
    data = {"dataset": dataset, **_grid(), "goodput": g, "results": res}
    _save(out, "ablation", data)
    _bar_plot(out, "ablation", {f"{m} {t}": {v: g[m][v][t]["monotone"] for v in g[m]} for m in g for t in GOODPUT_TARGETS},
              "goodput (req/s), monotone")
    return data


# (prompt-step overhead s, s per hybrid decode token, all-reduce call latency s or None for the link model),
# from public measurements (docs/step_costs.md), most telling first: the plain model; the pick (20 us per
# NCCL all-reduce over PCIe as in a CUDA graph, eager prompt steps 2 ms of launches plus ~30 us more on each of
# their 96 all-reduces, 10 us per hybrid decode); the step-type pick alone; the top of the evidence.
STEP_COSTS = ((0.0, 0.0, None), (0.005, 1e-5, 20e-6), (0.002, 1e-5, None), (0.005, 1e-4, None))


def _step_cost_key(overhead: float, hybrid: float, allreduce: float | None) -> str:
    key = f"{overhead * 1e3:g}ms+{hybrid * 1e6:g}us/dec"
    return key if allreduce is None else f"{key}+AR {allreduce * 1e6:g}us"


@EXPERIMENTS.register("stepcost")
def step_cost_sweep(out: Path, model="codellama-34b", dataset="sharegpt", num_requests=400,
                    strategies=("vllm", "sarathi", "ecoserve", "ecoserve_ref"), costs=STEP_COSTS) -> dict:
    """Goodput as steps that carry prompt tokens cost more (`StepTypeCosts`) and as all-reduce calls
    cost their measured latency, for each series; the JSON is saved after each point (a long sweep keeps
    what it has)."""
    res = {}
    for overhead, hybrid, allreduce in costs:
        key = _step_cost_key(overhead, hybrid, allreduce)
        knobs = {"step_costs": {"prompt_step_overhead_s": overhead, "hybrid_decode_token_s": hybrid}}
        if allreduce is not None:
            knobs["allreduce_latency_s"] = allreduce
        spec = l20_spec(model, perf_knobs=knobs)
        res[key] = {}
        for s in strategies:
            res[key][s] = _timed(s, spec, dataset, num_requests=num_requests)
            print(_line(f"{key} {s}", res[key][s]), flush=True)
        g = _compact(res)
        data = {"model": model, "dataset": dataset, **_grid(), "goodput": g, "results": res}
        _save(out, "stepcost", data)
    _bar_plot(out, "stepcost", {k: {s: v[s]["p90"]["monotone"] for s in v} for k, v in g.items()},
              "P90 goodput (req/s), monotone")
    return data


@EXPERIMENTS.register("windows")
def window_shares(out: Path, model="codellama-34b", dataset="sharegpt", rates=(10.0, 30.0, 50.0), num_requests=1500,
                  seed=3, strategies=("vllm", "sarathi", "ecoserve", "ecoserve_ref")) -> dict:
    """The mechanism at fixed loads: attainment, TTFT/TPOT p90 and each instance's busy time and window share."""
    ds = DATASETS.get(dataset)
    res: dict = {}
    for rate in rates:
        wl = synthetic(dataset, rate, num_requests, seed=seed)
        for s in strategies:
            strategy, opts = SERIES[s]
            run = build(strategy, l20_spec(model), ds.ttft_slo, ds.tpot_slo, **opts).run(wl)
            summary = summarize(run.records, ds.ttft_slo, ds.tpot_slo, run.num_submitted)
            inst = run.extra["instances"]
            windows = [i["num_windows"] for i in inst if i["num_windows"] is not None]
            res[f"{rate:g}/{s}"] = {
                "attainment": summary["attainment"], "ttft_p90": summary["ttft"]["p90"],
                "tpot_p90": summary["tpot"]["p90"], "busy": [round(i["busy_fraction"], 3) for i in inst],
                "windows": windows or None, "mean_window_s": [i["mean_window_s"] for i in inst] if windows else None,
                "window_share_min_max": [min(windows) * len(windows) / sum(windows),
                                         max(windows) * len(windows) / sum(windows)] if windows and sum(windows) else None}
            print(f"{rate:5g} req/s {s:12s} attainment {summary['attainment']:.3f}  busy "
                  f"{' '.join(f'{b:.2f}' for b in res[f'{rate:g}/{s}']['busy'])}  windows {windows or '-'}", flush=True)
    data = {"model": model, "dataset": dataset, "num_requests": num_requests, "seed": seed, "runs": res}
    _save(out, "windows", data)
    return data


@EXPERIMENTS.register("speed")
def speed(out: Path, num_requests: int = 100_000, strategies=("ecoserve", "vllm", "sarathi"), dataset: str = "alpaca",
          rate: float | None = None, model: str = "codellama-34b") -> dict:
    """Simulator speed: up to `num_requests` requests on the 8-instance L20 cluster, with a progress bar.

    Each strategy runs `num_requests` / 100, / 10 and / 1 requests; the PNG plots wall time against size.
    """
    ds = DATASETS.get(dataset)
    spec = l20_spec(model)
    rate = rate or 2.0 * spec.num_instances
    sizes = sorted({max(num_requests // 100, 1), max(num_requests // 10, 1), num_requests})
    runs = []
    for strategy in strategies:
        for n in sizes:
            wl = synthetic(dataset, rate, n, seed=0)
            t0, c0 = time.perf_counter(), time.process_time()
            res = build(strategy, spec, ds.ttft_slo, ds.tpot_slo).run(wl, progress=n == num_requests)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            tokens = sum(r.output_len for r in wl)
            runs.append({"strategy": strategy, "num_requests": n, "wall_s": wall, "cpu_s": cpu, "sim_s": res.sim_time,
                         "events": res.num_events, "steps": res.extra["num_steps"], "output_tokens": tokens,
                         "us_per_output_token": 1e6 * wall / tokens,
                         "summary": summarize(res.records, ds.ttft_slo, ds.tpot_slo, res.num_submitted)})
            print(f"{strategy:9s} {n:7d} requests: {wall:6.1f} s wall, {cpu:6.1f} s CPU, {res.sim_time:7.0f} s simulated, "
                  f"{runs[-1]['us_per_output_token']:.2f} us per output token", flush=True)
    data = {"dataset": dataset, "rate": rate, "runs": runs, "spec": asdict(spec)}
    _save(out, "speed", data)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for strategy in strategies:
        pts = [(r["num_requests"], r["wall_s"]) for r in runs if r["strategy"] == strategy]
        ax.loglog(*zip(*pts), "o-", label=strategy)
    ax.axhline(60, color="gray", ls="--", lw=0.8)
    ax.text(sizes[0], 60, "60 s target", va="bottom", fontsize=7, color="gray")
    ax.set_xlabel(f"requests ({dataset}, {rate:g} req/s, 8 x TP=4 L20)")
    ax.set_ylabel("wall time (s), one core")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "speed.png", dpi=120)
    plt.close(fig)
    return data
