"""The performance model of mixture-of-experts models: active vs total parameters, expert parallel, offload."""
import json

import pytest

from ecoserve.cli import main as cli_main
from ecoserve.sim.models import from_hf_config, model
from ecoserve.sim.moe import _GRID
from ecoserve.sim.perf import StepWork, make_perf


def decode(n: int, context: int = 512) -> StepWork:
    return StepWork(n, n, n, float(n * context), n * context, 0)


def test_catalogue_counts_total_and_active_parameters():
    mixtral, qwen3 = model("mixtral-8x7b"), model("qwen3-30b-a3b")
    assert mixtral.num_params / 1e9 == pytest.approx(46.7, abs=0.05)  # Mixtral-8x7B: 46.7B total, 12.9B active
    assert mixtral.num_layers * mixtral.active_params_per_layer / 1e9 == pytest.approx(12.6, abs=0.1)  # + embeddings
    assert qwen3.num_params / 1e9 == pytest.approx(30.5, abs=0.05) and qwen3.head_dim == 128
    assert model("llama-2-13b").num_params == 13_015_864_320  # dense models unchanged


def test_hf_configs_of_moe_families():
    qwen2_moe = from_hf_config({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
                                "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                                "intermediate_size": 5632, "moe_intermediate_size": 1408, "num_experts": 60,
                                "num_experts_per_tok": 4, "shared_expert_intermediate_size": 5632, "vocab_size": 151936})
    assert (qwen2_moe.num_experts, qwen2_moe.num_experts_per_tok, qwen2_moe.moe_intermediate_size,
            qwen2_moe.shared_expert_intermediate_size) == (60, 4, 1408, 5632)
    assert qwen2_moe.num_params / 1e9 == pytest.approx(14.3, abs=0.1)  # Qwen1.5-MoE-A2.7B: 14.3B total
    mixtral = from_hf_config({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
                              "num_experts_per_tok": 2, "vocab_size": 32000})
    assert mixtral.num_params == model("mixtral-8x7b").num_params


def test_moe_decode_reads_only_the_experts_it_touches():
    moe, dense = make_perf("qwen3-30b-a3b", "L20", tp=2), make_perf("qwen2.5-32b", "L20", tp=2)
    assert moe.work_time(decode(1)) < 0.3 * dense.work_time(decode(1))
    assert moe.work_time(decode(1)) < moe.work_time(decode(16)) < moe.work_time(decode(256))
    assert model("qwen3-30b-a3b").experts_touched(1) == pytest.approx(8) and \
        model("qwen3-30b-a3b").experts_touched(4096) == pytest.approx(128)


def test_expert_parallel_trades_the_mlp_all_reduce_for_two_all_to_alls():
    tp = make_perf("mixtral-8x7b", "L20", tp=4)
    ep = make_perf("mixtral-8x7b", "L20", tp=4, expert_parallel=True)
    ep_slow = make_perf("mixtral-8x7b", "L20", tp=4, expert_parallel=True, ep_link="10gbe")
    assert ep._moe.all_to_all_s(512) > ep._moe.all_to_all_s(16) > 0 and tp._moe.all_to_all_s(512) == 0
    assert ep_slow.work_time(decode(512)) > ep.work_time(decode(512)) + 0.05  # 10 GbE between the ranks
    assert make_perf("mixtral-8x7b", "L20", tp=1, expert_parallel=True)._moe.all_to_all_s(512) == 0


def test_offload_frees_memory_and_the_policy_beats_either_fixed_placement():
    full = make_perf("qwen3-30b-a3b", "L20", tp=1)
    assert full.kv_capacity_tokens == 0  # 61 GB of weights on a 48 GB GPU
    perfs = {pl: make_perf("qwen3-30b-a3b", "L20", tp=1, moe_resident_experts=32, expert_placement=pl,
                           expert_skew=0.5) for pl in ("aptmoe", "load", "host")}
    assert perfs["aptmoe"].kv_capacity_tokens > 100_000
    for n in _GRID:  # decode: the host wins; prefill: loading wins; the policy picks per expert
        ours = perfs["aptmoe"]._moe.offload_s(n)
        assert 0 < ours <= 1.001 * min(perfs["load"]._moe.offload_s(n), perfs["host"]._moe.offload_s(n))
    assert perfs["host"]._moe.offload_s(4096) > 1.5 * perfs["aptmoe"]._moe.offload_s(4096)
    assert perfs["load"]._moe.offload_s(1) > 3 * perfs["aptmoe"]._moe.offload_s(1)
    more = make_perf("qwen3-30b-a3b", "L20", tp=1, moe_resident_experts=80, expert_skew=0.5)
    assert more.work_time(decode(1)) < perfs["aptmoe"].work_time(decode(1))
    assert make_perf("qwen3-30b-a3b", "L20", tp=1, moe_resident_experts=128)._moe.offload_s(64) == 0


def test_moe_options_reject_bad_input():
    with pytest.raises(ValueError, match="not a mixture of experts"):
        make_perf("llama-3-8b", "L20", moe_resident_experts=4)
    with pytest.raises(ValueError, match=r"resident experts per layer must be in \[0, 8\]"):
        make_perf("mixtral-8x7b", "L20", moe_resident_experts=9)
    with pytest.raises(ValueError, match="placement"):
        make_perf("mixtral-8x7b", "L20", moe_resident_experts=4, expert_placement="gpu")


def test_simulate_run_plans_an_offloaded_moe(tmp_path, capsys):
    rc = cli_main(["simulate", "run", "--strategy", "vllm", "--model", "qwen3-30b-a3b", "--tp", "1",
                   "--num-instances", "2", "--moe-resident-experts", "48", "--expert-skew", "0.5",
                   "--dataset", "alpaca", "--rate", "2", "--num-requests", "20", "--out", str(tmp_path)])
    assert rc == 0
    assert json.loads((tmp_path / "run.json").read_text())["summary"]["num_finished"] == 20


def test_moe_offload_experiment_rows(tmp_path):
    from ecoserve.sim.moe_experiment import moe_offload

    data = moe_offload(tmp_path, budgets=(32, 120), placements=("aptmoe", "host"), num_requests=12)
    rows = {(r["resident_experts"], r["placement"]): r for r in data["rows"]}
    assert not rows[(120, "aptmoe")]["fits"]  # 120 experts a layer leave no room for KV on one L20
    ours, host = rows[(32, "aptmoe")], rows[(32, "host")]
    assert ours["num_finished"] == 12 and ours["output_tok_s"] >= host["output_tok_s"]
    assert (tmp_path / "moe_offload.json").exists()
