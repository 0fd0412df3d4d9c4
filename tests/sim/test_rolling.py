"""Rolling activation on the paper's cluster: windows roll evenly and cyclically over 8 instances."""
import pytest

from ecoserve.sim.cluster import build
from ecoserve.sim.experiments import l20_spec
from ecoserve.sim.workload import synthetic


@pytest.mark.parametrize("mode", ["paper", "reference"])
def test_windows_roll_over_every_instance(mode):
    # ShareGPT, CodeLlama-34B, 8 x L20 (TP=4), 10 req/s: a steady, light load.
    sim = build("ecoserve", l20_spec("codellama-34b"), 5.0, 0.1, router_mode=mode)
    res = sim.run(synthetic("sharegpt", 10.0, 500, seed=3))
    assert len(res.records) == 500
    counts = [i["num_windows"] for i in res.extra["instances"]]
    total = sum(counts)
    assert all(0.5 / 8 <= c / total <= 2 / 8 for c in counts), counts  # every instance, evenly
    opened = [iid for _, iid in sim.window_opens]
    assert all((b - a) % 8 == 1 for a, b in zip(opened, opened[1:])), opened  # the cursor advances cyclically
    if mode == "paper":
        assert max(i.sched.window.longest_open_s for i in sim.instances) <= 5.0 + 1e-9  # never beyond S_TTFT
    assert all(i["routed_fraction"] > 0 for i in res.extra["instances"])
