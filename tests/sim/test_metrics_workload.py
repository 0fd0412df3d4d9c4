"""Goodput curves, metric definitions, workload shapes and trace replay."""
import json

import numpy as np
import pytest

from ecoserve.sim.metrics import (CurveConfig, CurvePoint, RequestRecord, attainment, attainment_curve,
                                  goodput_from_curve, goodputs)
from ecoserve.sim.workload import ARRIVALS, DATASETS, load_trace, synthetic


def _evaluated(curve):
    """An attain_at function over `curve` that records the rates it was asked for."""
    asked = []

    def at(rate):
        asked.append(rate)
        return curve(rate)
    return at, asked


def test_curve_with_a_dip_gives_both_definitions():
    # passes at 1, dips at ~2, passes again up to 8, then falls off
    curve = lambda r: 0.8 if 1.5 < r < 2.5 else (1.0 if r <= 8.5 else 0.0)
    points = attainment_curve(curve, 1.0, CurveConfig(ratio=2 ** 0.5))
    assert [round(p.rate, 2) for p in points] == [1.0, 1.41, 2.0, 2.83, 4.0, 5.66, 8.0, 11.31, 16.0]
    g = goodput_from_curve(points, "p90")
    assert g["monotone"] == pytest.approx(2 ** 0.5) and g["max"] == pytest.approx(8.0)
    assert goodput_from_curve(list(reversed(points)), 0.9) == g  # order of the points does not matter


def test_curve_stops_after_two_rates_far_below_the_lowest_target():
    curve = lambda r: 1.0 if r <= 4 else (0.4 if r <= 6 else (0.7 if r <= 9 else 0.1))
    at, asked = _evaluated(curve)
    points = attainment_curve(at, 1.0, CurveConfig(ratio=1.5, stop_below=0.5, stop_after=2))
    # 0.4 at 5.06, then 0.7 at 7.59 resets the count; 0.1 at 11.39 and 17.09 ends it
    assert [round(r, 2) for r in asked] == [1.0, 1.5, 2.25, 3.38, 5.06, 7.59, 11.39, 17.09]
    assert [p.attainment for p in points][-4:] == [0.4, 0.7, 0.1, 0.1]
    at, asked = _evaluated(lambda r: 1.0)
    assert len(attainment_curve(at, 1.0, CurveConfig(max_points=7))) == 7 == len(asked)


def test_start_rate_that_misses_steps_down_until_one_passes():
    at, asked = _evaluated(lambda r: 1.0 if r < 0.3 else 0.0)
    points = attainment_curve(at, 1.0, CurveConfig(ratio=2.0, max_below=4))
    assert asked[:3] == [1.0, 0.5, 0.25] and points[0].rate == 0.25
    assert goodput_from_curve(points, 0.9) == {"monotone": 0.25, "max": 0.25}
    assert goodput_from_curve(attainment_curve(lambda r: 0.0, 1.0), 0.9) == {"monotone": 0.0, "max": 0.0}


def test_p99_and_p90_from_one_curve():
    curve = lambda r: 1.0 if r <= 2 else (0.95 if r <= 4 else (0.92 if r <= 6 else 0.0))
    at, asked = _evaluated(lambda r: CurvePoint(r, curve(r), ttft_p90=0.1 * r))
    points = attainment_curve(at, 1.0, CurveConfig(ratio=2.0))
    g = goodputs(points)
    assert g == {"p90": {"monotone": 4.0, "max": 4.0}, "p99": {"monotone": 2.0, "max": 2.0}}
    assert len(asked) == len(set(asked)) == len(points) and points[1].ttft_p90 == pytest.approx(0.2)


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


@pytest.mark.parametrize("bad", [dict(ratio=1.0), dict(ratio=0.5), dict(stop_below=0.0), dict(stop_after=0),
                                 dict(max_below=-1)])
def test_curve_config_rejects_a_grid_that_cannot_climb_or_stop(bad):
    from ecoserve.sim.metrics import CurveConfig
    with pytest.raises(ValueError):
        CurveConfig(**bad)
