"""Goodput search, metric definitions, workload shapes and trace replay."""
import json

import numpy as np
import pytest

from ecoserve.sim.metrics import RequestRecord, attainment, goodput
from ecoserve.sim.workload import ARRIVALS, DATASETS, load_trace, synthetic


def test_goodput_bisection_on_monotone_curve():
    curve = lambda r: 1.0 if r <= 3.7 else max(0.0, 1 - (r - 3.7))
    rate, seen = goodput(curve, "p90", lo=0.5, hi=1.0, rel_tol=0.01)
    assert 3.7 <= rate <= 3.8 * 1.01 and rate == pytest.approx(3.8, rel=0.02)
    assert goodput(curve, 0.99, lo=0.5, hi=1.0, rel_tol=0.01, num_gpus=4)[0] == pytest.approx(3.71 / 4, rel=0.02)
    assert goodput(lambda r: 0.0, 0.9)[0] == 0.0


def test_ttft_includes_phase_switch_wait_and_tpot_starts_after():
    r = RequestRecord("a", arrival=0.0, first_token=1.0, decode_start=1.5, finish=3.5, input_len=10, output_len=5)
    assert (r.ttft, r.ttft_first_token, r.tpot) == (1.5, 1.0, 0.5)
    assert r.meets(1.5, 0.5) and not r.meets(1.4, 0.5)
    assert attainment([r], 2.0, 1.0, num_submitted=4) == 0.25  # unfinished requests count as misses


@pytest.mark.parametrize("name", ["alpaca", "sharegpt", "longbench"])
def test_length_means_match_published(name):
    ds = DATASETS.get(name)
    reqs = synthetic(name, 1.0, 40_000, seed=3)
    assert np.mean([r.input_len for r in reqs]) == pytest.approx(ds.input.mean, rel=0.03)
    assert np.mean([r.output_len for r in reqs]) == pytest.approx(ds.output.mean, rel=0.03)


def test_gamma_arrivals_have_requested_rate_and_cv():
    gaps = np.diff(ARRIVALS.get("gamma")(4.0, 50_000, np.random.default_rng(0), cv=2.0))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.05)


def test_trace_replay_csv_and_jsonl(tmp_path):
    (tmp_path / "t.csv").write_text("arrival_time,input_len,output_len\n5.0,10,3\n4.0,20,4\n")
    reqs = load_trace(tmp_path / "t.csv")
    assert [(r.arrival_time, r.input_len) for r in reqs] == [(0.0, 20), (1.0, 10)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"timestamp": t, "prompt_len": 7, "output_len": 2})
                                                for t in (1, 3)))
    assert [r.arrival_time for r in load_trace(tmp_path / "t.jsonl", time_scale=0.5)] == [0.0, 1.0]
