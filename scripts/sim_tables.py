"""Print the markdown tables of docs/reproduction.md from the experiments' JSON.

    python scripts/sim_tables.py [results/sim]

Every `<experiment>.json` under the folder (searched recursively) is read; several `overall.json`
(e.g. one per model, run in parallel) are merged. EcoServe appears twice: `ecoserve` (paper mode)
and `ecoserve_ref` (reference mode, the authors' released scheduler).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

BASELINES = ("vllm", "sarathi", "distserve", "mooncake")
ECO = {"ecoserve": "paper mode", "ecoserve_ref": "reference mode"}
PAPER_OVER = {"vllm": "1.96x", "sarathi": "1.99x", "distserve": "2.51x", "mooncake": "2.40x"}
PAPER_DATASET_NODG = {"alpaca": "1.19x", "sharegpt": "1.26x", "longbench": "2.72x"}
PAPER_DATASET_FUDG = {"alpaca": "1.70x", "sharegpt": "4.00x", "longbench": "2.53x"}
PAPER_MODEL_NODG = {"llama-30b": "1.59x", "codellama-34b": "1.83x", "qwen2-72b": "1.76x"}
PAPER_SLO_DROP = {"ecoserve": "-57.1%", "ecoserve_ref": "-57.1%", "vllm": "-60.0%", "sarathi": "-72.9%",
                  "distserve": "-26.9%", "mooncake": "-23.9%"}
PAPER_BURST_DROP = {"ecoserve": "-17.3%", "ecoserve_ref": "-17.3%", "vllm": "-19.5%", "sarathi": "-35.7%",
                    "distserve": "-12.6%", "mooncake": "-17.1%"}
PAPER_SCALING = {"codellama-34b": "4.96x", "qwen2-72b": "5.47x"}


def _find(root: Path, name: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.rglob(f"{name}.json"))]


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def _mean(vals: list[float]) -> float | None:
    return sum(vals) / len(vals) if vals else None


def _drop(first: float, last: float) -> str:
    """The change from the first column to the last, signed (the paper reports drops as negative)."""
    return f"{100 * (last / first - 1):+.1f}%" if first else "n/a"


def overall(runs: list[dict]) -> None:
    res = {k: v for d in runs for k, v in d["results"].items()}
    g = {k: {s: r[s]["goodput"] for s in r} for k, r in res.items()}
    print("| model / dataset (P90 goodput, req/s) | vLLM | Sarathi | DistServe | MoonCake (P:D) | Eco paper | Eco ref |"
          " paper / vLLM | ref / vLLM | paper / Sarathi | ref / Sarathi |")
    print("|---" * 11 + "|")
    for key, r in res.items():
        mc = f"{r['mooncake']['goodput']:.1f} ({r['mooncake']['pd'][0]}:{r['mooncake']['pd'][1]})" if "mooncake" in r else "-"
        gk = g[key]
        print(f"| {key} | {_f(gk.get('vllm'))} | {_f(gk.get('sarathi'))} | {_f(gk.get('distserve'))} | {mc} | "
              f"{_f(gk.get('ecoserve'))} | {_f(gk.get('ecoserve_ref'))} | {_x(gk.get('ecoserve'), gk.get('vllm'))} | "
              f"{_x(gk.get('ecoserve_ref'), gk.get('vllm'))} | {_x(gk.get('ecoserve'), gk.get('sarathi'))} | "
              f"{_x(gk.get('ecoserve_ref'), gk.get('sarathi'))} |")
    print("\n| EcoServe / baseline (mean over cells) | paper mode | reference mode | paper (32 L20 GPUs) |\n|---|---|---|---|")
    for s in BASELINES:
        cells = [_mean([g[k][e] / g[k][s] for k in g if g[k].get(s) and e in g[k]]) for e in ECO]
        print(f"| {s} | " + " | ".join(_f(c, ".2f") + "x" if c else "n/a" for c in cells) + f" | {PAPER_OVER[s]} |")

    def vs(keys, e, group):
        out = []
        for k in keys:
            base = [g[k][s] for s in group if g[k].get(s) is not None]
            if base and sum(base) > 0 and e in g[k]:
                out.append(g[k][e] * len(base) / sum(base))
        return _mean(out)
    print("\n| P90, EcoServe / mean of the group, mean over cells | paper mode vs NoDG | reference mode vs NoDG | "
          "paper vs NoDG | paper mode vs FuDG | reference mode vs FuDG | paper vs FuDG |\n|---|---|---|---|---|---|---|")
    for ds in PAPER_DATASET_NODG:
        keys = [k for k in g if k.endswith("/" + ds)]
        if keys:
            print(f"| {ds} | " + " | ".join(_f(vs(keys, e, ("vllm", "sarathi")), ".2f") + "x" for e in ECO)
                  + f" | {PAPER_DATASET_NODG[ds]} | "
                  + " | ".join(_f(vs(keys, e, ("distserve", "mooncake")), ".2f") + "x" for e in ECO)
                  + f" | {PAPER_DATASET_FUDG[ds]} |")
    for m in PAPER_MODEL_NODG:
        keys = [k for k in g if k.startswith(m + "/")]
        if keys:
            print(f"| {m} | " + " | ".join(_f(vs(keys, e, ("vllm", "sarathi")), ".2f") + "x" for e in ECO)
                  + f" | {PAPER_MODEL_NODG[m]} | | | |")


def _by_series(d: dict, cols: list[str], paper_drop: dict[str, str]) -> None:
    g = d["goodput_p99"]
    print("| P99 goodput (req/s) | " + " | ".join(cols) + " | drop, first -> last | paper drop (A800) |")
    print("|---" * (len(cols) + 3) + "|")
    for s, v in g.items():
        name = f"EcoServe {ECO[s]}" if s in ECO else s
        print(f"| {name} | " + " | ".join(_f(v[c]) for c in cols) + f" | {_drop(v[cols[0]], v[cols[-1]])} | "
              f"{paper_drop.get(s, '')} |")


def slo(runs: list[dict]) -> None:
    _by_series(runs[0], list(next(iter(runs[0]["goodput_p99"].values()))), PAPER_SLO_DROP)


def burst(runs: list[dict]) -> None:
    _by_series(runs[0], ["1.2", "1.5", "2.0"], PAPER_BURST_DROP)


def scaling(runs: list[dict]) -> None:
    d = runs[0]
    print("| model / router | 1 | 2 | 3 | 4 instances | 1 -> 4 | paper 1 -> 4 |\n|---|---|---|---|---|---|---|")
    for m, v in d["goodput_p90"].items():
        model, series = m.split("/")
        print(f"| {model} {ECO.get(series, series)} | " + " | ".join(_f(v[k], ".2f") for k in ("1", "2", "3", "4"))
              + f" | {_x(v['4'], v['1'])} | {PAPER_SCALING.get(model, '')} |")


def ablation(runs: list[dict]) -> None:
    for m, by_t in runs[0]["goodput"].items():
        variants = list(next(iter(by_t.values())))
        print(f"| {m} | " + " | ".join(variants) + " |")
        print("|---" * (len(variants) + 1) + "|")
        for t, v in by_t.items():
            print(f"| {t} | " + " | ".join(_f(v[x]) for x in variants) + " |")


def stepcost(runs: list[dict]) -> None:
    g = runs[0]["goodput_p90"]
    series = list(next(iter(g.values())))
    print("| prompt-step overhead + per hybrid decode | " + " | ".join(series)
          + " | paper / Sarathi | ref / Sarathi | paper / vLLM | ref / vLLM |")
    print("|---" * (len(series) + 5) + "|")
    for key, v in g.items():
        print(f"| {key} | " + " | ".join(_f(v[s]) for s in series)
              + f" | {_x(v.get('ecoserve'), v.get('sarathi'))} | {_x(v.get('ecoserve_ref'), v.get('sarathi'))} | "
              f"{_x(v.get('ecoserve'), v.get('vllm'))} | {_x(v.get('ecoserve_ref'), v.get('vllm'))} |")


def mitosis(runs: list[dict]) -> None:
    """One table per run found (e.g. mitosis/ and mitosis_no_margin/, in path order)."""
    for d in runs:
        series = list(d["series"])
        print("| t (s) | rate | " + " | ".join(f"{ECO.get(e, e)}: attainment, instances, sizes" for e in series) + " |")
        print("|---" * (len(series) + 2) + "|")
        for rows in zip(*(d["series"][e] for e in series)):
            print(f"| {rows[0]['t']:.0f} | {rows[0]['rate']} | "
                  + " | ".join(f"{r['attainment']:.3f}, {r['instances']}, {r['sizes']}" for r in rows) + " |")
        print()


def windows(runs: list[dict]) -> None:
    print("| req/s / series | attainment | TTFT p90 (s) | TPOT p90 (ms) | windows per instance | window share "
          "(x 1/8), min-max | mean window (s), min-max | busy, min-max |\n|---|---|---|---|---|---|---|---|")
    for key, v in runs[0]["runs"].items():
        rate, s = key.split("/")
        mw = [w for w in (v["mean_window_s"] or []) if w is not None]
        share = v["window_share_min_max"]
        print(f"| {rate} {ECO.get(s, s)} | {v['attainment']:.3f} | {v['ttft_p90']:.2f} | {1e3 * v['tpot_p90']:.1f} | "
              f"{' '.join(map(str, v['windows'])) if v['windows'] else '-'} | "
              f"{f'{share[0]:.2f}-{share[1]:.2f}' if share else '-'} | "
              f"{f'{min(mw):.2f}-{max(mw):.2f}' if mw else '-'} | {min(v['busy']):.2f}-{max(v['busy']):.2f} |")


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "results/sim")
    for name, fn in (("overall", overall), ("slo", slo), ("burstiness", burst), ("scaling", scaling),
                     ("ablation", ablation), ("stepcost", stepcost), ("windows", windows), ("mitosis", mitosis)):
        runs = _find(root, name)
        if runs:
            print(f"### {name}\n")
            fn(runs)
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
