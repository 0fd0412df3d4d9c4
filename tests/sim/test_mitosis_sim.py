"""Mitosis in a simulated cluster: a split made under load lasts as long as the load does."""
import pytest

from ecoserve.cluster.events import Dispatch
from ecoserve.sim.cluster import ClusterSpec, build
from ecoserve.sim.workload import rate_schedule

RATE, DURATION, TTFT_SLO = 60.0, 40.0, 2.0  # sharegpt on llama-3-8b: more than one macro instance of N_u = 3 serves


@pytest.mark.parametrize("mode", ["paper", "reference"])
def test_a_split_persists_while_the_load_stays(mode):
    wl = rate_schedule("sharegpt", [(RATE, DURATION)], seed=0)
    sim = build("ecoserve", ClusterSpec(model="llama-3-8b", gpu="L20", tp=1, num_instances=3), TTFT_SLO, 0.1,
                total_instances=8, macro_sizes=[3], router_mode=mode, mitosis_period=1.0, ttft_window=10.0,
                mitosis=dict(n_lower=2, n_upper=3, cooldown_s=3.0))
    routed_to: dict[int, int] = {}  # macro -> requests dispatched after the first split
    original = sim.apply

    def watch(actions):
        topo = sim.controller.topology()
        if len(topo.macros) > 1:
            macro_of = {i: m for m, v in topo.macros.items() for i in v}
            for a in actions:
                if isinstance(a, Dispatch) and a.instance_id in macro_of:
                    routed_to[macro_of[a.instance_id]] = routed_to.get(macro_of[a.instance_id], 0) + 1
        return original(actions)
    sim.apply = watch
    res = sim.run(wl, horizon=1.0)
    timeline = [t for t in res.extra["timeline"] if t["time"] <= wl[-1].arrival_time]
    first = next((k for k, t in enumerate(timeline) if t["macros"] >= 2), None)
    assert first is not None and timeline[first]["time"] < 0.8 * DURATION, "it never split under the load"
    after = [t["macros"] for t in timeline[first:]]
    assert min(after) >= 2, after  # no collapse back into one macro instance while the load stays
    busy = sorted(routed_to.values())
    assert len(busy) >= 2 and busy[-2] >= 0.1 * sum(busy), routed_to  # the macro instances share the load
