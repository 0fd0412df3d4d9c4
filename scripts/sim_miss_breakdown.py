"""Which SLO a strategy misses, and for which requests (docs/reproduction.md, "Where P99 is lost").

    python scripts/sim_miss_breakdown.py [--rates 16 30] [--model codellama-34b] [--dataset sharegpt]

One Poisson run per strategy and rate (45 s of arrivals, seed 0, the experiments' cluster); for each,
the attainment and the misses split into TTFT only / TPOT only / both, with the median output length
of the TPOT missers against all requests', and the P99 TPOT.
"""
from __future__ import annotations

import argparse
import statistics

from ecoserve.sim.cluster import build
from ecoserve.sim.experiments import SERIES, l20_spec

# the experiments' series, and paper mode with the output hold (the ablation's `paper_hold`)
SERIES = {**SERIES, "ecoserve_paper_hold": ("ecoserve", {"router": {"output_hold": True}})}
from ecoserve.sim.workload import DATASETS, synthetic


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[16.0, 30.0])
    p.add_argument("--model", default="codellama-34b")
    p.add_argument("--dataset", default="sharegpt")
    p.add_argument("--series", default="sarathi,vllm,ecoserve,ecoserve_ref,ecoserve_paper_hold")
    p.add_argument("--duration", type=float, default=45.0)
    args = p.parse_args()
    ds = DATASETS.get(args.dataset)
    print(f"{args.model} / {args.dataset}, SLO {ds.ttft_slo} s / {ds.tpot_slo * 1000:.0f} ms, {args.duration:.0f} s of "
          f"arrivals per rate")
    print(f"{'rate':>5} {'series':<22}{'attain':>7}{'TTFT only':>10}{'TPOT only':>10}{'both':>6}"
          f"{'out len, TPOT missers':>23}{'all':>6}{'TPOT p99 ms':>12}")
    for rate in args.rates:
        wl = synthetic(args.dataset, rate, int(rate * args.duration), seed=0)
        for name in args.series.split(","):
            strategy, opts = SERIES[name]
            res = build(strategy, l20_spec(args.model), ds.ttft_slo, ds.tpot_slo, **opts).run(wl)
            recs = res.records
            ttft_miss = [r for r in recs if r.ttft > ds.ttft_slo]
            tpot_miss = [r for r in recs if r.tpot > ds.tpot_slo]
            both = len({r.request_id for r in ttft_miss} & {r.request_id for r in tpot_miss})
            met = sum(r.meets(ds.ttft_slo, ds.tpot_slo) for r in recs) / res.num_submitted
            tpots = sorted(r.tpot for r in recs)
            out_miss = statistics.median(r.output_len for r in tpot_miss) if tpot_miss else 0
            print(f"{rate:>5g} {name:<22}{met:>7.3f}{len(ttft_miss) - both:>10}{len(tpot_miss) - both:>10}{both:>6}"
                  f"{out_miss:>23.0f}{statistics.median(r.output_len for r in recs):>6.0f}"
                  f"{1000 * tpots[int(0.99 * (len(tpots) - 1))]:>12.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
