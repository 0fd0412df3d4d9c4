"""The simulated router predicts from a start-up profile, as live does, and paper-strict runs to the end."""
import pytest

from ecoserve.cluster.profile import PROFILE_TOKENS, StepTimeTable, profiling_lengths
from ecoserve.sim import cluster as sim_cluster
from ecoserve.sim.cluster import STRATEGIES, ClusterSpec, build
from ecoserve.sim.profiling import measured_prefill_table
from ecoserve.sim.workload import synthetic


def small_spec(**kw):
    return ClusterSpec(model="llama-3-8b", gpu="L20", tp=1, num_instances=4, **kw)


def test_paper_strict_finishes_every_request():
    wl = synthetic("sharegpt", 6.0, 150, seed=2)
    res = build("ecoserve", small_spec(), 5.0, 0.1, router_mode="paper-strict").run(wl)
    assert sorted(r.request_id for r in res.records) == sorted(r.request_id for r in wl)
    for r in res.records:
        assert r.arrival <= r.first_token <= r.decode_start <= r.finish


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_the_controller_predicts_from_the_live_profiling_lengths(name, monkeypatch):
    seen = []
    real = sim_cluster.build_controller

    def spy(strategy, options, clock, prefill_step_time, **kw):
        seen.append(prefill_step_time)
        return real(strategy, options, clock, prefill_step_time, **kw)
    monkeypatch.setattr(sim_cluster, "build_controller", spy)
    spec = small_spec()
    sim = build(name, spec, 5.0, 0.1)
    table = StepTimeTable([(n, sim.perf.predicted_prefill_time(n) * 1e3) for n in PROFILE_TOKENS])
    (step_time,) = seen
    for n in (1, 16, 40, 64, 256, 1000, 2048, 4096, 8192):
        assert step_time(n) == pytest.approx(table.seconds(n))
    assert step_time(2048) != pytest.approx(sim.perf.predicted_prefill_time(2048), rel=1e-3)  # not the oracle


def test_the_profiling_lengths_are_a_spec_knob():
    spec = small_spec(profile_tokens=(16, 64, 256))
    sim = build("ecoserve", spec, 5.0, 0.1)
    short = StepTimeTable([(n, sim.perf.predicted_prefill_time(n) * 1e3) for n in (16, 64, 256)])
    assert sim.controller.profile.step_time(4096) == pytest.approx(short.seconds(4096))


def test_profiling_lengths_fit_one_step_and_the_context():
    assert profiling_lengths(4096) == list(PROFILE_TOKENS)
    assert profiling_lengths(100) == [16, 64, 100]
    assert profiling_lengths(4096, max_model_len=50) == [16, 49]
    perf = small_spec(max_num_batched_tokens=64).perf()
    assert measured_prefill_table(perf, 64).rows == [(16, pytest.approx(perf.predicted_prefill_time(16) * 1e3)),
                                                     (64, pytest.approx(perf.predicted_prefill_time(64) * 1e3))]


def test_profile_lengths_must_be_positive():
    from ecoserve.cluster.profile import profiling_lengths
    with pytest.raises(ValueError, match="positive"):
        profiling_lengths(512, token_counts=(16, 0))
    with pytest.raises(ValueError, match="positive"):
        profiling_lengths(512, token_counts=())


def test_simulate_rejects_bad_profile_tokens(capsys):
    from ecoserve.cli import main
    assert main(["simulate", "run", "--profile-tokens", "16,abc", "--num-requests", "10"]) != 0
    assert "--profile-tokens takes comma-separated token counts" in capsys.readouterr().err
