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


STEPS = """kind,prompt_tokens,decode_seqs,context,ms
prefill,16,0,0,10
prefill,64,0,0,30
decode,0,1,32,5
decode,0,8,32,9
decode,0,1,128,7
decode,0,8,128,13
hybrid,16,1,32,14
hybrid,16,8,32,16
hybrid,64,1,32,33
hybrid,64,8,32,36
"""


def _steps(tmp_path, text=STEPS):
    path = tmp_path / "steps.csv"
    path.write_text(text)
    return path


def test_step_profile_selected_by_header_and_tokens_ms_table_still_read(tmp_path):
    from ecoserve.sim.perf import StepProfilePerf
    assert isinstance(make_perf("codellama-34b", profile=_steps(tmp_path)), StepProfilePerf)
    _, table = _table("L20-Llama-13B.csv")
    assert isinstance(make_perf("llama-2-13b", profile=table), TablePerf)


def test_step_profile_prefill_interpolates_and_extrapolates(tmp_path):
    p = make_perf("codellama-34b", profile=_steps(tmp_path))
    assert p.step_ms(16, 0, 0) == 10 and p.step_ms(40, 0, 0) == pytest.approx(20)
    assert p.step_ms(8, 0, 0) == 10  # below the first row: its time
    assert p.step_ms(128, 0, 0) == pytest.approx(30 + 64 * 20 / 48)  # along the last segment
    assert p.predicted_prefill_time(64) == pytest.approx(0.030)
    assert p.work_time(StepWork(64, 2, 2, 0.0, 64, 64)) == pytest.approx(0.030)  # two prompts: by their tokens


def test_step_profile_decode_is_bilinear_in_sequences_and_context(tmp_path):
    p = make_perf("codellama-34b", profile=_steps(tmp_path))
    assert p.step_ms(0, 8, 128) == 13
    mid_b = lambda c: 5 + (9 - 5) * 0.5 if c == 32 else 7 + (13 - 7) * 0.5  # noqa: E731
    assert p.step_ms(0, 4.5, 32) == pytest.approx(mid_b(32))
    assert p.step_ms(0, 4.5, 80) == pytest.approx((mid_b(32) + mid_b(128)) / 2)
    assert p.step_ms(0, 8, 224) == pytest.approx(13 + 4)  # context past the grid: along the last segment
    # from a StepWork: 4 decodes of 80 tokens of context each
    assert p.work_time(StepWork(4, 4, 4, 4 * 80.0, 4 * 80, 0)) == pytest.approx(p.step_ms(0, 4, 80) * 1e-3)


def test_step_profile_hybrid_exact_at_measured_points_and_held_outside(tmp_path):
    p = make_perf("codellama-34b", profile=_steps(tmp_path))
    assert p.step_ms(64, 8, 32) == pytest.approx(36)
    assert p.step_ms(16, 1, 32) == pytest.approx(14)
    # beyond the hybrid grid the residual stays at its edge: 64 prompt + 8 decodes at 128 context
    residual = 36 - 30 - 9
    assert p.step_ms(64, 8, 128) == pytest.approx(30 + 13 + residual)
    assert p.step_ms(256, 8, 32) == pytest.approx(p.step_ms(256, 0, 0) + 9 + residual)
    w = StepWork(72, 9, 9, 0.0, 64 + 8 * 32, 64)  # 64 prompt tokens (from 0) + 8 decodes of 32 context
    assert p.work_time(w) == pytest.approx(0.036)


def test_step_profile_without_hybrid_rows_adds_prefill_and_decode(tmp_path):
    text = "\n".join(ln for ln in STEPS.splitlines() if not ln.startswith("hybrid")) + "\n"
    p = make_perf("codellama-34b", profile=_steps(tmp_path, text))
    assert p.step_ms(64, 8, 32) == pytest.approx(30 + 9)


@pytest.mark.parametrize("text, match", [
    ("kind,prompt_tokens,decode_seqs,ms\nprefill,16,0,10\n", "expected the header"),
    (STEPS.replace("decode,0,8,128,13\n", ""), "full grid"),
    (STEPS.replace("hybrid,64,8,32,36", "hybrid,64,8,32,x"), "bad row"),
    (STEPS.replace("prefill,16,0,0,10", "verify,16,0,0,10"), "unknown step kind"),
    ("\n".join(ln for ln in STEPS.splitlines() if not ln.startswith("decode")), "needs prefill and decode"),
])
def test_step_profile_bad_files_fail_clearly(tmp_path, text, match):
    from ecoserve.sim.perf import StepProfilePerf
    with pytest.raises(ValueError, match=match):
        StepProfilePerf.from_csv(_steps(tmp_path, text))


def test_validate_cluster_metrics_and_errors_on_fake_data():
    import importlib.util
    import sys
    script = Path(__file__).parents[2] / "scripts" / "validate_cluster.py"
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location("validate_cluster", script)
    vc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vc)
    # 4 sent, 3 finished: TPOTs 0.1, 0.3 and a one-token request (meets any TPOT)
    m = vc.latency_metrics([0.5, 2.0, 0.4], [1.5, 5.0, 0.4], [11, 11, 1], 4, slo_ttft=1.0, slo_tpot=0.2)
    assert m["slo_attainment"] == 0.5 and m["completed"] == 3
    assert m["p50_ttft_ms"] == pytest.approx(500) and m["p90_tpot_ms"] == pytest.approx(280)
    sim = {**m, "p50_ttft_ms": 550.0, "slo_attainment": 0.25}
    c = vc.compare(m, sim)
    assert c["ape"]["p50_ttft_ms"] == pytest.approx(0.1) and c["ape"]["slo_attainment"] == pytest.approx(0.5)
    assert c["mape"] == pytest.approx(0.6 / 5)
    zero = vc.compare({**m, "slo_attainment": 0.0}, sim)
    assert zero["ape"]["slo_attainment"] is None and zero["mape"] == pytest.approx(0.1 / 4)
    s = vc.summary({"a": c, "b": zero})
    assert s["mape_per_metric"]["slo_attainment"] == pytest.approx(0.5)
    assert "**MAPE per metric**" in vc.markdown({"a": c, "b": zero}, s)


def test_validate_cluster_mean_profile(tmp_path):
    import importlib.util
    import sys
    script = Path(__file__).parents[2] / "scripts" / "validate_cluster.py"
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location("validate_cluster", script)
    vc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vc)
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(STEPS)
    b.write_text(STEPS.replace("prefill,16,0,0,10", "prefill,16,0,0,20"))
    mean = vc.mean_profile([a, b], tmp_path / "m.csv")
    assert make_perf("codellama-34b", profile=mean).step_ms(16, 0, 0) == pytest.approx(15)
    b.write_text(STEPS.replace("prefill,16,0,0,10", "prefill,17,0,0,20"))
    with pytest.raises(ValueError, match="one grid"):
        vc.mean_profile([a, b], tmp_path / "m.csv")
