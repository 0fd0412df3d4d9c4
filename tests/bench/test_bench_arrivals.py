"""Arrival process and dispatch: gamma gaps, Poisson at burstiness 1, inf rate, max concurrency."""
import asyncio
import time

import numpy as np
import pytest

from ecoserve.bench.client import RequestInput
from ecoserve.bench.metrics import RequestOutput
from ecoserve.bench.serve import _dispatch, arrival_times, gamma_intervals


def cv(x: np.ndarray) -> float:
    return float(x.std() / x.mean())


@pytest.mark.parametrize("burstiness, expected_cv", [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)])
def test_gamma_gaps_have_the_rate_and_cv(burstiness, expected_cv):
    gaps = gamma_intervals(40000, 5.0, burstiness, np.random.default_rng(0))
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.03)
    assert cv(gaps) == pytest.approx(expected_cv, rel=0.05)  # 1/sqrt(shape); 1 is Poisson


def test_arrival_times_are_seeded_monotone_and_renormalized():
    a = arrival_times(500, 20.0, 1.0, np.random.default_rng(7))
    b = arrival_times(500, 20.0, 1.0, np.random.default_rng(7))
    assert np.array_equal(a, b)
    assert np.all(np.diff(a) >= 0) and a[0] > 0
    assert a[-1] == pytest.approx(500 / 20.0)  # realized rate is exactly the asked one
    assert not np.array_equal(a, arrival_times(500, 20.0, 1.0, np.random.default_rng(8)))


def test_inf_rate_is_all_at_zero_and_bad_values_raise():
    assert np.array_equal(arrival_times(10, float("inf"), 1.0, np.random.default_rng(0)), np.zeros(10))
    with pytest.raises(ValueError, match="burstiness"):
        gamma_intervals(3, 1.0, 0.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="request-rate"):
        gamma_intervals(3, -1.0, 1.0, np.random.default_rng(0))


class SlowSender:
    """Stands in for an HTTP sender: counts requests in flight, takes `hold` seconds each."""

    def __init__(self, hold: float):
        self.hold, self.in_flight, self.peak = hold, 0, 0

    async def __call__(self, session, req: RequestInput) -> RequestOutput:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        t = time.perf_counter()
        await asyncio.sleep(self.hold)
        self.in_flight -= 1
        return RequestOutput(prompt_len=req.prompt_len, output_tokens=1, success=True, generated_text="x",
                             ttft=time.perf_counter() - t, latency=time.perf_counter() - t)


def inputs(n: int) -> list[RequestInput]:
    return [RequestInput("http://unused", "m", "p", 1, 1) for _ in range(n)]


def test_inf_rate_sends_everything_at_once():
    sender = SlowSender(0.05)
    outs, dur = asyncio.run(_dispatch(None, sender, inputs(20), np.zeros(20), None, True))
    assert sender.peak == 20
    assert max(o.start_time for o in outs) < 0.03
    assert dur < 0.5


def test_max_concurrency_is_respected():
    sender = SlowSender(0.02)
    outs, dur = asyncio.run(_dispatch(None, sender, inputs(12), np.zeros(12), 3, True))
    assert sender.peak == 3
    assert all(o.success for o in outs)
    assert dur >= 4 * 0.02 * 0.9  # 12 requests through 3 slots: four rounds


def test_dispatch_follows_the_arrival_times():
    times = arrival_times(10, 50.0, 1.0, np.random.default_rng(1))
    outs, dur = asyncio.run(_dispatch(None, SlowSender(0.001), inputs(10), times, None, True))
    starts = np.array([o.start_time for o in outs])
    assert np.all(starts >= times - 1e-3)
    assert np.all(starts - times < 0.05)
    assert dur >= times[-1]
