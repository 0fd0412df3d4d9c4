"""NoDG and FuDG decide exactly as before the controller extraction: same steps, same metrics.

The fixture was recorded from the simulator-subclass code (main at ad61eae) with
`python tests/sim/test_decisions_fixture.py --record`; every step's chunks and every request's
times must match it. The PaDG cases (both router modes) were recorded the same way from main at
1d847b0 (`--record padg`), before the simulator speed pass, which must not change any decision.
"""
import hashlib
import json
import sys
from pathlib import Path

import pytest

from ecoserve.sched.scheduler import Scheduler

FIXTURE = Path(__file__).parent / "fixtures" / "nodg_fudg_decisions.json"
CASES = {  # name -> (strategy, dataset, rate, num_requests, seed, options)
    "vllm": ("vllm", "sharegpt", 6.0, 120, 2, {}),
    "vllm_least_loaded": ("vllm", "alpaca", 12.0, 120, 3, {"balance": "least_loaded"}),
    "sarathi": ("sarathi", "sharegpt", 6.0, 120, 2, {}),
    "distserve": ("distserve", "sharegpt", 6.0, 120, 2, {}),
    "mooncake_1p3d": ("mooncake", "longbench", 1.0, 40, 5, {"pd": (1, 3)}),
}
PADG_FIXTURE = FIXTURE.with_name("padg_decisions.json")
PADG_CASES = {
    "ecoserve_paper": ("ecoserve", "sharegpt", 12.0, 150, 2, {"router_mode": "paper"}),
    "ecoserve_reference": ("ecoserve", "sharegpt", 12.0, 150, 2, {"router_mode": "reference"}),
}


def _build():
    try:
        from ecoserve.sim.cluster import build
    except ImportError:  # the recorded (pre-extraction) layout
        from ecoserve.sim.strategies import build
    return build


def run_case(name: str) -> dict:
    from ecoserve.sim.cluster import ClusterSpec
    from ecoserve.sim.workload import synthetic
    strategy, dataset, rate, n, seed, opts = {**CASES, **PADG_CASES}[name]
    steps = []
    original = Scheduler.schedule

    def schedule(self):
        out = original(self)
        if out.chunks:
            steps.append((f"{self.clock.now():.9g}",
                          tuple((c.request.request_id, c.start, c.num_tokens) for c in out.chunks)))
        return out

    Scheduler.schedule = schedule
    try:
        spec = ClusterSpec(model="llama-3-8b", gpu="L20", tp=1, num_instances=4)
        res = _build()(strategy, spec, 5.0, 0.1, **opts).run(synthetic(dataset, rate, n, seed=seed))
    finally:
        Scheduler.schedule = original
    records = sorted((r.request_id, f"{r.first_token:.9g}", f"{r.decode_start:.9g}", f"{r.finish:.9g}")
                     for r in res.records)
    return {"num_steps": len(steps), "steps_sha256": hashlib.sha256(repr(steps).encode()).hexdigest(),
            "records": records}


@pytest.mark.parametrize("name", sorted(CASES) + sorted(PADG_CASES))
def test_same_decisions_as_recorded(name):
    want = json.loads((PADG_FIXTURE if name in PADG_CASES else FIXTURE).read_text())[name]
    got = run_case(name)
    assert got["num_steps"] == want["num_steps"]
    assert [list(r) for r in got["records"]] == want["records"]
    assert got["steps_sha256"] == want["steps_sha256"]


if __name__ == "__main__" and "--record" in sys.argv:
    path, cases = (PADG_FIXTURE, PADG_CASES) if "padg" in sys.argv else (FIXTURE, CASES)
    path.write_text(json.dumps({k: run_case(k) for k in sorted(cases)}, indent=0))
    print(f"wrote {path}")
