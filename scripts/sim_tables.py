"""Print the markdown tables of docs/reproduction.md from results/sim/*.json.

    python scripts/sim_tables.py [results/sim]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

STRATS = ("vllm", "sarathi", "distserve", "mooncake", "ecoserve")


def _load(d: Path, name: str) -> dict | None:
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def overall(d: dict) -> None:
    res = d["results"]
    print("| model / dataset (P90 goodput, req/s) | vLLM | Sarathi | DistServe | MoonCake (P:D) | EcoServe | "
          "Eco / vLLM | Eco / Sarathi |")
    print("|---|---|---|---|---|---|---|---|")
    for key, r in res.items():
        g = {s: r[s]["goodput"] if s in r else None for s in STRATS}
        mc = f"{g['mooncake']:.1f} ({r['mooncake']['pd'][0]}:{r['mooncake']['pd'][1]})" if g["mooncake"] is not None else "-"
        cells = [f"{g[s]:.1f}" if g[s] is not None else "-" for s in ("vllm", "sarathi", "distserve")]
        print(f"| {key} | {' | '.join(cells)} | {mc} | {g['ecoserve']:.1f} | {_ratio(g['ecoserve'], g['vllm'])} | "
              f"{_ratio(g['ecoserve'], g['sarathi'])} |")
    print()
    print("| EcoServe / baseline (mean over cells) | ours | paper (32 L20 GPUs) |\n|---|---|---|")
    paper = {"vllm": "1.96x", "sarathi": "1.99x", "distserve": "2.51x", "mooncake": "2.40x"}
    for s, v in d["ecoserve_over"].items():
        print(f"| {s} | {v:.2f}x | {paper[s]} |" if v else f"| {s} | n/a | {paper[s]} |")
    print()
    print("| dataset (P90) | EcoServe / mean NoDG (vLLM, Sarathi), mean over models | "
          "EcoServe / best NoDG | paper vs NoDG |\n|---|---|---|---|")
    paper_ds = {"alpaca": "1.19x", "sharegpt": "1.26x", "longbench": "2.72x"}
    for ds in paper_ds:
        cells = [r for k, r in res.items() if k.endswith("/" + ds)]
        if not cells:
            continue
        mean_r = [2 * r["ecoserve"]["goodput"] / (r["vllm"]["goodput"] + r["sarathi"]["goodput"]) for r in cells
                  if r["vllm"]["goodput"] + r["sarathi"]["goodput"] > 0]
        best_r = [r["ecoserve"]["goodput"] / max(r["vllm"]["goodput"], r["sarathi"]["goodput"]) for r in cells
                  if max(r["vllm"]["goodput"], r["sarathi"]["goodput"]) > 0]
        print(f"| {ds} | {sum(mean_r) / len(mean_r):.2f}x | {sum(best_r) / len(best_r):.2f}x | {paper_ds[ds]} |")


def slo(d: dict) -> None:
    g = d["goodput_p99"]
    cols = list(next(iter(g.values())))
    print("| P99 goodput (req/s) | " + " | ".join(cols) + " | drop loosest -> strictest |")
    print("|---" * (len(cols) + 2) + "|")
    for s, v in g.items():
        drop = d["drop_loosest_to_strictest"][s]
        print(f"| {s} | " + " | ".join(f"{v[c]:.1f}" for c in cols) + f" | {'n/a' if drop is None else f'{100 * drop:.1f}%'} |")


def burst(d: dict) -> None:
    g = d["goodput_p99"]
    print("| P99 goodput (req/s) | CV 1.2 | CV 1.5 | CV 2.0 | drop 1.2 -> 2.0 |\n|---|---|---|---|---|")
    for s, v in g.items():
        drop = d["drop_cv1.2_to_2.0"][s]
        print(f"| {s} | {v['1.2']:.1f} | {v['1.5']:.1f} | {v['2.0']:.1f} | {'n/a' if drop is None else f'{100 * drop:.1f}%'} |")


def scaling(d: dict) -> None:
    print("| model | 1 | 2 | 3 | 4 instances | 1 -> 4 |\n|---|---|---|---|---|---|")
    for m, v in d["goodput_p90"].items():
        print(f"| {m} | " + " | ".join(f"{v[k]:.2f}" for k in ("1", "2", "3", "4")) + f" | {d['scale_1_to_4'][m]:.2f}x |")


def ablation(d: dict) -> None:
    for m, by_t in d["goodput"].items():
        variants = list(next(iter(by_t.values())))
        print(f"| {m} | " + " | ".join(variants) + " |")
        print("|---" * (len(variants) + 1) + "|")
        for t, v in by_t.items():
            print(f"| {t} | " + " | ".join(f"{v[x]:.1f}" for x in variants) + " |")


def mitosis(d: dict) -> None:
    print("| t (s) | rate | attainment | instances | macro sizes |\n|---|---|---|---|---|")
    for s in d["series"]:
        print(f"| {s['t']:.0f} | {s['rate']} | {s['attainment']:.3f} | {s['instances']} | {s['sizes']} |")


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "results/sim")
    for name, fn in (("overall", overall), ("slo", slo), ("burstiness", burst), ("scaling", scaling),
                     ("ablation", ablation), ("mitosis", mitosis)):
        d = _load(root, name)
        if d is not None:
            print(f"### {name}\n")
            fn(d)
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
