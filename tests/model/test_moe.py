"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against HF transformers, and the grouped expert compute."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ecoserve import LLM, SamplingParams
from ecoserve.model.loader import load_model
from ecoserve.model.moe import ExpertShard, SparseMoeBlock, fused_experts, route
from ecoserve.model.packed import NativeExperts, PackedExperts
from ecoserve.kernels.paths import onednn_linear
from ecoserve.model.spec import ModelLoadError, ModelSpec
from tests.utils import MOE_CONFIGS, hf_logprobs, make_tiny_moe_checkpoint, prompts

MAX_NEW = 16
LOGPROB_ATOL = 2e-3


def naive_experts(x, ids, weights, w_gate_up, w_down):
    """transformers' per-expert loop: the reference for the grouped compute."""
    out = torch.zeros_like(x)
    inter = w_down.shape[-1]
    for e in range(w_gate_up.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel():
            gate_up = F.linear(x[token], w_gate_up[e])
            h = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w_down[e])
            out.index_add_(0, token, (h * weights[token, slot, None]).to(x.dtype))
    return out


def expert_weights(num_experts=6, hidden=16, inter=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_experts, 2 * inter, hidden, generator=gen).to(dtype) * 0.3,
            torch.randn(num_experts, hidden, inter, generator=gen).to(dtype) * 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_per_expert_loop_when_experts_get_none_or_all_tokens(dtype):
    w_gate_up, w_down = expert_weights(dtype=dtype)
    x = torch.randn(7, 16).to(dtype)
    # every token picks expert 2; experts 0 and 5 get no token; expert 4 only the last token
    ids = torch.tensor([[2, 1], [3, 2], [2, 1], [1, 2], [2, 3], [3, 2], [4, 2]])
    weights = torch.softmax(torch.randn(7, 2), dim=-1)
    got = fused_experts(x, ids, weights, w_gate_up, w_down)
    want = naive_experts(x, ids, weights, w_gate_up, w_down)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 if dtype == torch.float32 else 2e-2)
    assert fused_experts(x[:0], ids[:0], weights[:0], w_gate_up, w_down).shape == (0, 16)


def test_expert_shards_sum_to_the_whole():
    """Expert-parallel ranks hold disjoint experts; their partial outputs add up to the single process's."""
    w_gate_up, w_down = expert_weights()
    x, ids = torch.randn(9, 16), torch.randint(0, 6, (9, 3))
    weights = torch.rand(9, 3)
    whole = fused_experts(x, ids, weights, w_gate_up, w_down)
    parts = [fused_experts(x, ids, weights, w_gate_up[r * 3:(r + 1) * 3], w_down[r * 3:(r + 1) * 3], r * 3)
             for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-6, atol=1e-6)
    only_rank1 = torch.full((9, 3), 4)
    assert fused_experts(x, only_rank1, weights, w_gate_up[:3], w_down[:3], 0).abs().max() == 0


needs_onednn_bf16 = pytest.mark.skipif(not onednn_linear(torch.bfloat16), reason="oneDNN has no bfloat16 on this CPU")


@needs_onednn_bf16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_equal_the_plain_ones(dtype):
    """oneDNN-packed experts give the plain grouped compute's output (the same rounding in bfloat16) and
    unpack bit for bit; expert-parallel slices of the packed lists still add up."""
    w_gate_up, w_down = expert_weights(dtype=dtype)
    packed = PackedExperts(w_gate_up, w_down)
    x, ids = torch.randn(9, 16).to(dtype), torch.tensor([[2, 1]] * 6 + [[3, 5], [5, 3], [0, 2]])
    weights = torch.softmax(torch.randn(9, 2), dim=-1)
    got = fused_experts(x, ids, weights, packed.gate_up, packed.down, linear=packed.linear)
    want = fused_experts(x, ids, weights, w_gate_up, w_down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 if dtype == torch.float32 else 1e-2)
    halves = [fused_experts(x, ids, weights, packed.gate_up[r * 3:(r + 1) * 3], packed.down[r * 3:(r + 1) * 3],
                            r * 3, packed.linear) for r in range(2)]
    torch.testing.assert_close(halves[0] + halves[1], got, rtol=1e-5, atol=1e-6 if dtype == torch.float32 else 2e-2)
    assert all(torch.equal(a, b) for a, b in zip(packed.unpacked(), (w_gate_up, w_down)))


@needs_onednn_bf16
@pytest.mark.parametrize("dtype, cpu_linear, packed", [("bfloat16", "auto", True), ("bfloat16", "torch", False),
                                                       ("float32", "auto", False), ("float32", "onednn", True)])
def test_loader_packs_experts_where_cpu_linear_says(tmp_path, dtype, cpu_linear, packed):
    """Packed for oneDNN as `--cpu-linear` says, and for the native grouped kernel wherever it runs the dtype."""
    packed = packed or (cpu_linear != "torch" and NativeExperts.supports(getattr(torch, dtype)))
    path = make_tiny_moe_checkpoint(tmp_path / "m", "qwen3_moe")
    block = load_model(str(path), dtype=dtype, cpu_linear=cpu_linear).model.layers[0].mlp
    plain = load_model(str(path), dtype=dtype, cpu_linear="torch").model.layers[0].mlp
    assert (block.packed_experts is not None) == packed
    assert block.w_gate_up.numel() == 0 if packed else torch.equal(block.w_gate_up, plain.w_gate_up)
    assert (block.gate.prepacked is not None) == (cpu_linear != "torch") and plain.gate.prepacked is None
    x = torch.randn(5, block.gate.weight.shape[1]).to(getattr(torch, dtype))
    torch.testing.assert_close(block.gate(x), plain.gate(x), rtol=1e-5, atol=1e-5 if dtype == "float32" else 1e-2)
    torch.testing.assert_close(block(x), plain(x), rtol=1e-5, atol=1e-5 if dtype == "float32" else 1e-2)
    block.unpack_experts()  # what the expert pool does: the plain stacked weights back
    assert block.packed_experts is None
    assert torch.equal(block.w_gate_up, plain.w_gate_up) and torch.equal(block.w_down, plain.w_down)


def torch_route(logits, top_k, normalize, weight_dtype):
    """transformers' routing in torch ops, the reference for the native pass."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weight_dtype), ids


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (60, 4), (64, 8), (128, 8), (512, 8)])
def test_native_route_picks_the_experts_torch_picks(num_experts, top_k, threads, torch_threads):
    """The same experts in the same order as torch's softmax and top-k, ties included (bfloat16 logits tie
    often, and at the k-th place the tie decides which expert runs); 512 of 8 takes torch's partial-sort path."""
    from ecoserve.kernels import fused_ops

    native = fused_ops()
    if native is None:
        pytest.skip("no native kernels on this machine")
    torch_threads(threads)
    gen = torch.Generator().manual_seed(num_experts)
    logits = (torch.randn(3000, num_experts, generator=gen) * 2).to(torch.bfloat16)
    ties = 0
    for dtype in (torch.bfloat16, torch.float32):
        for normalize in (False, True):
            for weight_dtype in (torch.bfloat16, torch.float32):
                x = logits.to(dtype)
                got_w, got_ids = route(x, top_k, normalize, weight_dtype)
                want_w, want_ids = torch_route(x, top_k, normalize, weight_dtype)
                assert torch.equal(got_ids, want_ids) and got_w.dtype == weight_dtype
                # exp and sums differ in the last float32 bits, which can round a bfloat16 weight the other way
                if weight_dtype == torch.float32:
                    torch.testing.assert_close(got_w, want_w, rtol=5e-6, atol=0)
                else:
                    torch.testing.assert_close(got_w, want_w, rtol=2 ** -7, atol=0)  # one bfloat16 step
                    assert (got_w != want_w).float().mean() < 0.01
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(top_k + 1).values
        ties += (probs[:, -1] == probs[:, -2]).sum().item()
    assert ties > 0  # the case that needs torch's order did occur
    with pytest.raises(RuntimeError, match="top_k"):
        native.moe_route(logits, num_experts + 1, False, False)
    with pytest.raises(RuntimeError, match=r"logits \[T, E\]"):
        native.moe_route(logits[None], top_k, False, False)


def test_router_matches_transformers_rules():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.bfloat16)
    w, ids = route(logits, 2, normalize=False, weight_dtype=torch.bfloat16)
    probs = torch.softmax(logits.float(), dim=-1)
    assert ids.tolist() == [[0, 1]] and w.dtype == torch.bfloat16
    assert torch.equal(w, probs[:, :2].to(torch.bfloat16))
    w, _ = route(logits, 2, normalize=True, weight_dtype=torch.float32)  # Mixtral: renormalised, kept float32
    assert w.dtype == torch.float32 and w.sum().item() == pytest.approx(1.0)


@pytest.fixture(scope="module", params=list(MOE_CONFIGS))
def moe_checkpoint(request, tmp_path_factory):
    return request.param, make_tiny_moe_checkpoint(tmp_path_factory.mktemp(request.param) / "m", request.param)


def test_spec_and_layers(moe_checkpoint):
    arch, path = moe_checkpoint
    spec = ModelSpec.from_dir(path)
    model = load_model(str(path)).model
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert spec.moe.num_experts == 8 and spec.moe.top_k == MOE_CONFIGS[arch]["num_experts_per_tok"]
    if arch == "qwen3_moe":
        assert kinds == ["SparseMoeBlock", "GatedMLP", "SparseMoeBlock"] and spec.moe.norm_topk_prob
    else:
        assert kinds == ["SparseMoeBlock"] * 2
    assert (spec.moe.shared_expert_intermediate_size > 0) == (arch == "qwen2_moe")
    assert spec.moe.weights_in_model_dtype == (arch != "mixtral")


MODES = {"chunked_prefix_cache": dict(max_num_batched_tokens=48),
         "no_prefix_cache_block8": dict(enable_prefix_caching=False, block_size=8)}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_and_logprobs_equal_hf(moe_checkpoint, mode):
    """A mixed batch (1-120 tokens, a shared prefix), chunked prefill over paged KV: HF's tokens and logprobs."""
    _, path = moe_checkpoint
    shared = prompts(1, seed=9, min_len=70, max_len=70)[0]
    ps = prompts(4, seed=2, min_len=1, max_len=120) + [shared + [40], shared + [50, 51]]
    llm = LLM(str(path), **MODES[mode])
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3, ignore_eos=True), use_tqdm=False)
    for p, out in zip(ps, outs):
        ref_tokens, ref_steps = hf_logprobs(path, p, MAX_NEW, num_logprobs=3, ignore_eos=True)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(p)} tokens diverged"
        for mine, ref, tok in zip(got.logprobs, ref_steps, ref_tokens):
            assert mine[tok] == pytest.approx(ref[tok], abs=LOGPROB_ATOL)
    if mode == "chunked_prefix_cache":
        assert llm.llm_engine.scheduler.kv.prefix_hits > 0


def test_bfloat16_matches_hf_bfloat16(tmp_path):
    from tests.utils import hf_logits

    path = make_tiny_moe_checkpoint(tmp_path / "m", "qwen2_moe")
    model = load_model(str(path), dtype="bfloat16").model
    ids = prompts(1, seed=4, min_len=30, max_len=30)[0]
    from tests.utils import DenseCausalAttention

    hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention())
    got = model.compute_logits(hidden)
    want = hf_logits(path, ids, dtype=torch.bfloat16)
    assert model.layers[0].mlp.w_gate_up.dtype == torch.bfloat16
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    assert (got - want).abs().max() < 0.25 * want.abs().max()


def test_stacked_expert_tensors_load_like_per_expert_ones(tmp_path):
    """transformers 5's fused layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) loads too."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_moe_checkpoint(tmp_path / "m", "mixtral")
    reference = load_model(str(path)).model
    tensors = load_file(path / "model.safetensors")
    for layer in range(2):
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        pop = lambda e, w: tensors.pop(f"{prefix}.{e}.{w}.weight")  # noqa: E731
        experts = [(pop(e, "w1"), pop(e, "w3"), pop(e, "w2")) for e in range(8)]
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(g_u[:2]) for g_u in experts])
        tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([d for *_, d in experts])
    save_file(tensors, path / "model.safetensors")
    model = load_model(str(path)).model
    for got, want in zip(model.layers, reference.layers):
        assert torch.equal(got.mlp.w_gate_up, want.mlp.w_gate_up) and torch.equal(got.mlp.w_down, want.mlp.w_down)


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes,match", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 exceeds the 8 experts"),
    (dict(num_experts=0), "num_experts must be a positive integer"),
    (dict(mlp_only_layers="all"), "mlp_only_layers must be a list"),
    (dict(num_experts=4), "names expert 4, but config.json has 4 experts"),
    (dict(moe_intermediate_size=16), r"experts.0.down_proj.weight' has shape \(64, 32\), config.json implies \(64, 16\)"),
])
def test_bad_configs_are_named(tmp_path, changes, match):
    path = make_tiny_moe_checkpoint(tmp_path / "m", "qwen3_moe", num_hidden_layers=2, mlp_only_layers=[])
    edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(path))


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_moe_checkpoint(tmp_path / "m", "qwen2_moe")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    del tensors["model.layers.0.mlp.shared_expert_gate.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing 2 tensors.*layers.0.mlp\[shared_expert_gate\].*"
                                             r"layers.1.mlp\[experts.5.up\]"):
        load_model(str(path))


def test_expert_parallel_needs_experts_divisible_by_ranks():
    spec = ModelSpec.from_config({"architectures": ["MixtralForCausalLM"], "hidden_size": 16, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "intermediate_size": 24, "vocab_size": 32,
                                  "num_local_experts": 6, "num_experts_per_tok": 2})
    assert ExpertShard.of(spec.moe, 3, 2, expert_parallel=True) == ExpertShard(4, 2, 24, 0)
    assert ExpertShard.of(spec.moe, 2, 1) == ExpertShard(0, 6, 12, 12)
    with pytest.raises(ModelLoadError, match="splits the 6 experts over tensor_parallel_size 4"):
        ExpertShard.of(spec.moe, 4, 0, expert_parallel=True)
    with pytest.raises(ModelLoadError, match="must divide the experts' intermediate size 24"):
        SparseMoeBlock(16, spec.moe, torch.float32, type("TP", (), {"size": 5, "rank": 0})())


def test_structured_outputs_beside_plain_rows(tmp_path):
    """A MoE batch mixing constrained and plain requests: the plain rows are unchanged, the others match."""
    import re

    from ecoserve.structured import StructuredOutputsParams

    path = make_tiny_moe_checkpoint(tmp_path / "m", "mixtral")
    llm = LLM(str(path), max_num_batched_tokens=32)
    ps = [{"prompt_token_ids": p} for p in prompts(4, seed=8)]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(ps, plain, use_tqdm=False)
    guided = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="x[0-9]{2}!"))
    mixed = llm.generate(ps, [plain, guided] * 2, use_tqdm=False)
    for i in (0, 2):
        assert mixed[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
    for i in (1, 3):
        assert re.fullmatch(r"x[0-9]{2}!", mixed[i].outputs[0].text), mixed[i].outputs[0].text


def test_expert_benchmark_script_runs(tmp_path):
    """scripts/bench_moe_experts.py (the grouped-vs-loop figures' command), tiny shapes."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "scripts" / "bench_moe_experts.py"), "--tokens", "1", "6",
                          "--experts", "4", "--top-k", "2", "--hidden", "32", "--intermediate", "16", "--repeats", "2",
                          "--dtypes", "float32", "--threads", "1", "--json", str(tmp_path / "out.json")],
                         capture_output=True, text=True, cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin"},
                         timeout=300)
    assert run.returncode == 0, run.stderr
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 6] and all(r["grouped_ms"] > 0 and r["loop_ms"] > 0 for r in rows)
    assert rows[0]["active_experts"] == 2
