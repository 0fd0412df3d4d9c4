"""Performance model: calibration against the measured L20 table, and its physical trends."""
from pathlib import Path

import numpy as np
import pytest

import ecoserve.sim
from ecoserve.sim.models import MODELS, load_config
from ecoserve.sim.perf import StepWork, TablePerf, make_perf

PROFILES = Path(ecoserve.sim.__file__).parent / "profiles"  # the measured L20 tables the package ships


def _table(name):
    path = PROFILES / name
    return np.loadtxt(path, delimiter=",", skiprows=1), str(path)


def test_roofline_reproduces_l20_llama2_13b_within_10_percent_from_1_to_2048():
    d, _ = _table("L20-Llama-13B.csv")
    perf = make_perf("llama-2-13b", "L20", tp=1)
    pred = np.array([perf.predicted_prefill_time(int(n)) * 1e3 for n in d[:, 0]])
    err = np.abs(pred / d[:, 1] - 1)
    assert d[0, 0] == 1 and d[-1, 0] == 2048
    assert err.max() <= 0.10, f"worst {err.max():.3f} at {int(d[err.argmax(), 0])} tokens"
    assert err.mean() <= 0.06


def test_table_model_interpolates_and_extrapolates():
    d, path = _table("L20-Llama-13B.csv")
    t = TablePerf.from_csv(path)
    assert t.predicted_prefill_time(1024) == pytest.approx(d[1023, 1] / 1e3)
    assert t.predicted_prefill_time(4096) > t.predicted_prefill_time(2048) * 1.8


def test_model_catalogue_sizes():
    assert MODELS.get("llama-2-13b").num_params == pytest.approx(13.0e9, rel=0.01)
    assert MODELS.get("llama-30b").kv_bytes_per_token / 2**20 == pytest.approx(1.52, abs=0.01)  # paper A2
    assert MODELS.get("codellama-34b").kv_bytes_per_token == 48 * 2 * 8 * 128 * 2
    assert MODELS.get("qwen2-72b").num_params == pytest.approx(72.7e9, rel=0.01)


def test_local_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
                                          '"num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}')
    m = load_config(tmp_path)
    assert m.head_dim == 16 and m.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2


def test_trends_kv_reads_tp_and_network():
    p1 = make_perf("codellama-34b", "L20", tp=4)
    short = p1.work_time(StepWork(64, 64, 64, 64 * 100, 64 * 100))
    long = p1.work_time(StepWork(64, 64, 64, 64 * 4000, 64 * 4000))
    assert long > short * 1.2  # decode reads the KV cache
    slow = make_perf("codellama-34b", "L20", tp=4, link="10gbe")
    assert slow.predicted_prefill_time(1024) > p1.predicted_prefill_time(1024) * 2
    h100 = make_perf("codellama-34b", "H100", tp=4)
    assert h100.predicted_prefill_time(2048) < p1.predicted_prefill_time(2048) / 3
    assert 500_000 < p1.kv_capacity_tokens < 560_000  # reference C3: ~535k tokens


def test_step_type_costs_charge_only_prompt_carrying_steps():
    from ecoserve.sim.perf import StepTypeCosts
    plain = make_perf("codellama-34b", "L20", tp=4)
    costly = make_perf("codellama-34b", "L20", tp=4, step_costs={"prompt_step_overhead_s": 0.015,
                                                                  "hybrid_decode_token_s": 0.0005})
    decode = StepWork(32, 32, 32, 32 * 500.0, 32 * 500, 0)
    prefill = StepWork(512, 1, 1, 512 * 513 / 2, 512, 512)
    hybrid = StepWork(512, 33, 33, 512 * 481 / 2 + 32 * 500, 480 + 32 * 500, 480)  # 32 decodes + 480 prompt
    assert costly.work_time(decode) == plain.work_time(decode)  # a pure decode replays its CUDA graph
    assert costly.work_time(prefill) == pytest.approx(plain.work_time(prefill) + 0.015)
    assert costly.work_time(hybrid) == pytest.approx(plain.work_time(hybrid) + 0.015 + 32 * 0.0005)
    assert costly.predicted_prefill_time(512) == pytest.approx(plain.predicted_prefill_time(512) + 0.015)
    with pytest.raises(ValueError, match=">= 0"):
        StepTypeCosts(prompt_step_overhead_s=-1.0)


def test_allreduce_latency_knob_sets_the_per_call_cost():
    """A measured per-call latency replaces the link's 2(tp-1) hops: 96 calls per CodeLlama-34B step."""
    work = StepWork(64, 64, 64, 64 * 1000, 64 * 1000, 0)
    ring = make_perf("codellama-34b", "L20", tp=4)
    measured = make_perf("codellama-34b", "L20", tp=4, allreduce_latency_s=50e-6)
    calls = 2 * 48
    assert measured.work_time(work) - ring.work_time(work) == pytest.approx(calls * (50e-6 - 12e-6), rel=1e-6)
    single = make_perf("codellama-34b", "L20", tp=1, allreduce_latency_s=50e-6)
    assert single.work_time(work) == pytest.approx(make_perf("codellama-34b", "L20", tp=1).work_time(work))
    with pytest.raises(ValueError):
        make_perf("codellama-34b", "L20", tp=4, allreduce_latency_s=-1e-6)


def test_step_cost_points_build_models_and_name_their_all_reduce():
    from ecoserve.sim.experiments import STEP_COSTS, _step_cost_key

    work = StepWork(512, 33, 33, 480 * 481 / 2 + 32 * 1000, 480 + 32 * 1000, 480)
    plain = make_perf("codellama-34b", "L20", tp=4).work_time(work)
    for overhead, hybrid, allreduce in STEP_COSTS:
        knobs = {"step_costs": {"prompt_step_overhead_s": overhead, "hybrid_decode_token_s": hybrid}}
        if allreduce is not None:
            knobs["allreduce_latency_s"] = allreduce
        t = make_perf("codellama-34b", "L20", tp=4, **knobs).work_time(work)
        assert t >= plain + overhead + 32 * hybrid - 1e-9
        assert ("AR" in _step_cost_key(overhead, hybrid, allreduce)) == (allreduce is not None)
    assert _step_cost_key(0.005, 1e-5, 20e-6) == "5ms+10us/dec+AR 20us"
