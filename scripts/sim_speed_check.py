"""Process CPU time of a simulator run and a checksum of every request's times (speed work must not move them).

    python scripts/sim_speed_check.py 100000 ecoserve,vllm [--profile]

Alpaca-shaped requests at 16 req/s on the 8-instance L20 cluster (CodeLlama-34B, TP=4, 10 GbE), the
`ecoserve simulate speed` setup; `ecoserve_ref` is EcoServe with the reference router. Run it against
another checkout with PYTHONPATH=<that tree> to compare: the sha must be equal, the CPU time is the score.
"""
import cProfile
import hashlib
import pstats
import sys
import time

from ecoserve.sim.cluster import build
from ecoserve.sim.experiments import SERIES, l20_spec
from ecoserve.sim.workload import DATASETS, synthetic


def main() -> int:
    n, series, profile = int(sys.argv[1]), sys.argv[2].split(","), "--profile" in sys.argv
    ds, spec = DATASETS.get("alpaca"), l20_spec("codellama-34b")
    for s in series:
        strategy, opts = SERIES[s]
        sim = build(strategy, spec, ds.ttft_slo, ds.tpot_slo, **opts)
        wl = synthetic("alpaca", 16.0, n, seed=0)
        prof = cProfile.Profile() if profile else None
        t0 = time.process_time()
        if prof:
            prof.enable()
        res = sim.run(wl, progress=False)
        cpu = time.process_time() - t0
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        h = hashlib.sha256()
        for r in sorted(res.records, key=lambda r: r.request_id):
            h.update(f"{r.request_id},{r.arrival!r},{r.first_token!r},{r.decode_start!r},{r.finish!r};".encode())
        print(f"{s} n={n} cpu_s={cpu:.1f} steps={res.extra['num_steps']} records={len(res.records)} "
              f"sha={h.hexdigest()[:16]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
