"""Speculative decoding in the simulator: the live scheduler takes several tokens per verified decode."""
import json

import pytest

from ecoserve.cli import main as cli_main
from ecoserve.sim.cluster import ClusterSpec, build
from ecoserve.sim.metrics import summarize
from ecoserve.sim.speculation import SpeculationModel
from ecoserve.sim.workload import synthetic


def run(speculation, rate=2.0, n=60, strategy="vllm"):
    spec = ClusterSpec(model="llama-3-8b", gpu="L20", tp=1, num_instances=2, speculation=speculation)
    res = build(strategy, spec, 5.0, 0.1).run(synthetic("sharegpt", rate, n, seed=5))
    return res


def tpots(res):
    return {r.request_id: r.tpot for r in res.records}


def test_full_acceptance_emits_every_proposal_and_lowers_tpot():
    plain, spec = run(None), run(SpeculationModel(1.0, 3))
    assert sorted(r.request_id for r in spec.records) == sorted(r.request_id for r in plain.records)
    counters = spec.extra["spec_decode"]
    assert counters["num_accepted_tokens"] == counters["num_draft_tokens"] > 0
    assert 3.5 < counters["acceptance_length"] <= 4.0  # short of 4 only where a request's end cut its proposals
    assert spec.extra["num_steps"] < 0.7 * plain.extra["num_steps"]  # prefills and arrivals keep some
    # a decode of 4 tokens costs about one of 1 token on the memory-bound GPU: TPOT falls by well over half
    mean = lambda res: sum(tpots(res).values()) / len(res.records)
    assert mean(spec) < 0.4 * mean(plain)


def test_auto_at_zero_acceptance_is_no_speculation():
    plain, spec = run(None), run(SpeculationModel(0.0, "auto"))
    assert spec.extra["spec_decode"]["num_drafts"] == 0
    assert [(r.request_id, r.finish) for r in spec.records] == [(r.request_id, r.finish) for r in plain.records]


def test_fixed_k_at_low_acceptance_pays_the_verification():
    plain, spec = run(None, rate=6.0, n=120), run(SpeculationModel(0.05, 8), rate=6.0, n=120)
    assert spec.extra["spec_decode"]["acceptance_length"] < 1.1
    assert sum(tpots(spec).values()) > sum(tpots(plain).values())


def test_draft_cost_and_auto():
    cheap, dear = run(SpeculationModel(0.8, 4)), run(SpeculationModel(0.8, 4, draft_cost=0.5))
    assert sum(tpots(dear).values()) > sum(tpots(cheap).values())
    auto = run(SpeculationModel(0.8, "auto", draft_cost=0.5))
    assert 1.0 < auto.extra["spec_decode"]["acceptance_length"]
    assert sum(tpots(auto).values()) < sum(tpots(dear).values())  # fewer, surer proposals than k=4 at this cost


def test_deterministic_and_slo_summary():
    a, b = run(SpeculationModel(0.6, 3)), run(SpeculationModel(0.6, 3))
    assert [(r.request_id, r.finish) for r in a.records] == [(r.request_id, r.finish) for r in b.records]
    plain = run(None)
    assert summarize(a.records, 5.0, 0.1, a.num_submitted)["attainment"] >= \
        summarize(plain.records, 5.0, 0.1, plain.num_submitted)["attainment"]


def test_model_checks_its_input():
    with pytest.raises(ValueError, match="acceptance rate"):
        SpeculationModel(1.5)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculationModel(0.5, 0)
    with pytest.raises(ValueError, match="draft cost"):
        SpeculationModel(0.5, 2, draft_cost=-1)


def test_simulate_run_flags(tmp_path, capsys):
    rc = cli_main(["simulate", "run", "--strategy", "vllm", "--model", "llama-3-8b", "--tp", "1", "--num-instances",
                   "2", "--dataset", "alpaca", "--rate", "4", "--num-requests", "30", "--out", str(tmp_path),
                   "--num-speculative-tokens", "auto", "--spec-acceptance-rate", "0.8"])
    assert rc == 0
    assert json.loads((tmp_path / "run.json").read_text())["extra"]["spec_decode"]["num_drafts"] > 0
    assert "speculative decoding:" in capsys.readouterr().out
    assert cli_main(["simulate", "run", "--num-speculative-tokens", "many", "--out", str(tmp_path)]) == 2
    assert "--num-speculative-tokens takes an integer >= 1 or auto" in capsys.readouterr().err
