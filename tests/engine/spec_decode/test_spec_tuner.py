"""The speculation-length tuner on fake cost tables and acceptance rates, against choices worked out by hand."""
import pytest

from ecoserve.engine.spec_decode.length import Acceptance, LengthQuery, StepTimes
from ecoserve.engine.spec_decode.tuner import (SpeculationTuner, TunedLength, TunerConfig, expected_tokens, plan,
                                               step_seconds)


def ms(f):
    """A cost in milliseconds by token count, as seconds."""
    return lambda n: f(n) * 1e-3


def test_expected_tokens():
    assert expected_tokens(0, 0.3) == 1.0
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(2, 1.0) == 3.0
    assert expected_tokens(4, 0.0) == 1.0
    with pytest.raises(ValueError, match="alpha in"):
        expected_tokens(2, 1.5)


def test_flat_cost_proposes_all_it_may():
    # memory-bound: a step of 1..9 tokens costs the same, so every proposal is free tokens
    assert plan([0.8], [4], ms(lambda n: 10.0)) == [4]


def test_compute_bound_cost_never_speculates():
    # each token costs its own time: E(k)/(k+1) < 1 for any alpha < 1
    assert plan([0.9], [8], ms(lambda n: float(n))) == [0]


def test_batch_one_optimum_between():
    # T(n) = 10 + 2(n-1) ms, alpha 0.6: k=0 1/10 = .100, k=1 1.6/12 = .133, k=2 1.96/14 = .140,
    # k=3 2.176/16 = .136 tokens/ms -> k=2
    assert plan([0.6], [8], ms(lambda n: 10 + 2 * (n - 1))) == [2]


def test_split_between_requests_by_acceptance():
    # two requests, T(n) = 10 + 2(n-2) ms; gains .9, .81, .729, .6561, .5905 (all request 0) before .531 and
    # request 1's .3: M=4 5.0951/18 = .28306, M=5 5.68559/20 = .28428, M=6 6.21703/22 = .28259 -> [5, 0]
    assert plan([0.9, 0.3], [8, 8], ms(lambda n: 10 + 2 * (n - 2))) == [5, 0]
    # a cap stops request 0 at 2; then .3 (request 1) is the next gain: M=2 3.71/14 = .2650, M=3 4.01/16 = .2506
    assert plan([0.9, 0.3], [2, 8], ms(lambda n: 10 + 2 * (n - 2))) == [2, 0]


def test_large_batch_backs_off():
    # 64 decodes fill the memory-bound step (10 ms); past it each token costs 1 ms and returns < 1 token
    cost = ms(lambda n: 10.0 if n <= 64 else 10.0 + (n - 64))
    assert plan([0.9] * 64, [8] * 64, cost) == [0] * 64
    # the same requests at batch 4 speculate fully: the step stays at 10 ms up to 36 tokens
    assert plan([0.9] * 4, [8] * 4, cost) == [8] * 4


def test_prompt_tokens_in_the_step_count():
    # the same two decodes, alone in the step (memory-bound) or beside a 62-token prompt chunk: there
    # 6 proposals would add at most 2 * (.7 + .49 + .343) tokens to 64 and 6 ms to 10 (4.2 against 6.4 tokens/ms)
    cost = ms(lambda n: 10.0 if n <= 64 else 10.0 + (n - 64))
    assert plan([0.7, 0.7], [3, 3], cost, base_tokens=2) == [3, 3]
    assert plan([0.7, 0.7], [3, 3], cost, base_tokens=64) == [0, 0]


def test_draft_cost():
    # flat 10 ms target, 3 ms per draft pass, alpha 0.5: k=0 .100, k=1 1.5/13 = .1154, k=2 1.75/16 = .1094 -> 1
    assert plan([0.5], [8], ms(lambda n: 10.0), draft_seconds=ms(lambda n: 3.0)) == [1]
    assert plan([0.5], [8], ms(lambda n: 10.0)) == [8]
    # two requests share each draft pass: 2 + .5 + .5 over 10 + 3 = .2308, not 2 + .5 over 13 = .1923
    assert plan([0.5, 0.5], [8, 8], ms(lambda n: 10.0), draft_seconds=ms(lambda n: 3.0)) == [1, 1]


def test_token_budget_and_margin():
    assert plan([0.9, 0.9], [8, 8], ms(lambda n: 10.0), max_tokens=5) == [2, 1]
    # best is k=1 at 1.1/10.8 = .1019 against .1000: 1.9% better, under a 2% margin
    cost = ms(lambda n: 10.0 + 0.8 * (n - 1))
    assert plan([0.1], [8], cost) == [1]
    assert plan([0.1], [8], cost, min_speedup=1.02) == [0]


def test_plan_checks_its_input():
    with pytest.raises(ValueError, match="one cap per request"):
        plan([0.5], [1, 2], ms(lambda n: 1.0))
    assert plan([], [], ms(lambda n: 1.0)) == []


def times(rows):
    return StepTimes(seconds=dict(rows))


def test_step_seconds_reads_the_measured_rows():
    assert step_seconds(times([])) is None and step_seconds(times([(4, 0.01)])) is None
    read = step_seconds(times([(1, 0.010), (9, 0.012), (17, 0.020)]))
    assert read(5) == pytest.approx(0.011)
    assert read(1) == read(0) == 0.010  # below the first row: its time
    assert read(25) == pytest.approx(0.028)  # past the last: along the last two rows
    falling = step_seconds(times([(1, 0.010), (9, 0.008)]))
    assert falling(50) == 0.008  # noise never makes a bigger step cheaper


def test_acceptance_estimates():
    tuner = SpeculationTuner(TunerConfig(prior_acceptance=0.7, prior_weight=4.0, workload_decay=1.0))
    assert tuner.acceptance("a") == pytest.approx(0.7)
    tuner.observe_verification("a", 4, 4)  # four trials, four successes
    tuner.observe_verification("a", 4, 2)  # two successes and the rejection: three trials
    # workload: (6 + 4 * .7) / (7 + 4) = .8; request: (6 + 4 * .8) / (7 + 4)
    assert tuner.workload_acceptance() == pytest.approx(0.8)
    assert tuner.acceptance("a") == pytest.approx(9.2 / 11)
    assert tuner.acceptance("b") == pytest.approx(0.8)  # a new request starts from the workload's rate
    tuner.forget("a")
    assert tuner.acceptance("a") == pytest.approx(0.8)
    with pytest.raises(ValueError, match="accepted 5 of 4"):
        tuner.observe_verification("a", 4, 5)


def test_tuner_measures_then_plans():
    tuner = SpeculationTuner(TunerConfig(max_k=4, prior_acceptance=0.8))
    assert tuner.choose(["a"]) == {"a": 0}  # nothing measured: a plain step first
    tuner.step_times.add(1, 0.010)
    assert tuner.choose(["a"]) == {"a": 4}  # then one with the most proposals
    tuner.step_times.add(5, 0.010)
    assert tuner.choose(["a"]) == {"a": 4}  # flat cost, alpha .8: speculate fully
    assert tuner.choose(["a", "b"], caps=[2, 0]) == {"a": 2, "b": 0}  # no more than a request may propose
    assert tuner.stats.chosen == {0: 2, 4: 2, 2: 1}
    assert tuner.stats.mean_k() == pytest.approx(10 / 5)


def test_tuner_backs_off_and_probes():
    config = TunerConfig(max_k=4, prior_acceptance=0.9, probe_interval=3)
    tuner = SpeculationTuner(config, times([(1, 0.010), (5, 0.018)]))  # 2 ms per extra token
    assert tuner.choose(["a"])["a"] > 0
    for _ in range(20):
        tuner.observe_verification("a", 4, 0)
    # alpha ~ .04: no k pays, but at alpha 1 it would (5/18 > 1/10), so every third step probes with one token
    assert [tuner.choose(["a"])["a"] for _ in range(6)] == [0, 0, 1, 0, 0, 1]


def test_tuner_no_probes_when_the_batch_rules_speculation_out():
    tuner = SpeculationTuner(TunerConfig(max_k=4, probe_interval=1), times([(1, 0.001), (64, 0.064)]))
    assert set(tuner.choose([f"r{i}" for i in range(16)]).values()) == {0}


def test_tuner_uses_the_draft_cost():
    draft = times([(1, 0.003)])
    tuner = SpeculationTuner(TunerConfig(max_k=8, prior_acceptance=0.5, min_speedup=1.0),
                             times([(1, 0.010), (9, 0.010)]), draft_times=draft)
    assert tuner.choose(["a"]) == {"a": 1}  # as test_draft_cost
    draft.seconds[1] = 0.0005  # the draft got cheap
    assert tuner.choose(["a"])["a"] > 1


def test_tuned_length_reads_the_speculators_records():
    """The engine's policy for "auto": acceptance from the growth of each request's record, one plan per step."""
    length = TunedLength(TunerConfig(max_k=4, prior_acceptance=0.5, prior_weight=1.0, workload_decay=1.0))
    step = times([(1, 0.010), (5, 0.010)])  # flat: speculate whatever the rate
    a, b = Acceptance(), Acceptance()
    query = lambda rid, acc, cap=4: LengthQuery(rid, 2, cap, acc, step)
    assert length.choose_all([query("a", a), query("b", b, cap=2)]) == [4, 2]
    a.add(4, 4)  # all four accepted: four trials, four successes
    b.add(2, 0)  # rejected at once: one trial
    length.choose_all([query("a", a), query("b", b)])
    tuner = length.tuner
    # workload (4 + 0.5) / (5 + 1) = .75; a: (4 + .75) / (4 + 1) = .95; b: (0 + .75) / (1 + 1) = .375
    assert tuner.workload_acceptance() == pytest.approx(0.75)
    assert tuner.acceptance("a") == pytest.approx(0.95)
    assert tuner.acceptance("b") == pytest.approx(0.375)
    length.choose_all([query("a", a)])  # no new verification: nothing counted twice
    assert tuner.acceptance("a") == pytest.approx(0.95)
    length.forget(["a"])
    assert tuner.acceptance("a") == pytest.approx(0.75)
    assert length.choose(query("c", Acceptance())) == 4 and length.max_tokens == 4
    length.observe_draft(1, 4, 0.040)  # a draft pass costs as much as the target's step: no proposal pays
    assert tuner.draft_times.seconds == {1: 0.010}
    assert length.choose(query("c", Acceptance())) == 0


def test_config_checks():
    with pytest.raises(ValueError, match="max_k"):
        TunerConfig(max_k=0)
    with pytest.raises(ValueError, match="prior_acceptance"):
        TunerConfig(prior_acceptance=1.5)
