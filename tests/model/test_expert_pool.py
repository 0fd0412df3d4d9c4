"""The expert pool: a resident budget below the experts places them between host and device, outputs unchanged."""
from __future__ import annotations

import pytest
import torch

from ecoserve import LLM, SamplingParams
from ecoserve.model.expert_pool import ExpertPool
from ecoserve.model.loader import load_model
from ecoserve.model.moe import SparseMoeBlock, route
from ecoserve.moe import CostTable
from tests.utils import make_tiny_checkpoint, make_tiny_moe_checkpoint, prompts

# fake costs: the host takes 1 s per token, a transfer 2.5 s: experts with <= 2 tokens stay on the host
FAKE = CostTable(host_s=lambda n: float(n), device_s=lambda n: 0.1 * n, load_s=2.5)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):  # 8 experts, top-2, 2 sparse layers
    return make_tiny_moe_checkpoint(tmp_path_factory.mktemp("mixtral") / "m", "mixtral")


def blocks_of(model) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def test_blocks_equal_the_full_model_while_experts_move(mixtral):
    model = load_model(str(mixtral), cpu_linear="torch").model  # plain weights: the pool's GEMMs, bit for bit
    blocks = blocks_of(model)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, blocks[0].w_gate_up.shape[-1], generator=gen) for n in (1, 3, 40, 2, 64, 1)]
    want = [[b(x) for b in blocks] for x in xs]
    pool = ExpertPool.attach(model, 3, costs=FAKE)
    assert [pool.resident(i) for i in range(2)] == [frozenset({0, 1, 2})] * 2  # the initial fill
    routed = 0
    for x, ref in zip(xs, want):
        for layer, b in enumerate(blocks):
            routed += len(set(route(b.gate(x), 2, True, torch.float32)[1].flatten().tolist()))
            assert torch.equal(b(x), ref[layer])  # top-2: the partial sums add up bit for bit
            assert len(pool.resident(layer)) <= 3
    s = pool.stats
    assert s.hits + s.loads + s.host_computed == routed
    assert s.hits > 0 and s.loads > 0 and s.host_computed > 0 and s.prefetches > 0 and s.evictions > 0
    assert s.bytes_moved % pool.expert_bytes == 0 and s.bytes_moved >= (s.loads + s.prefetches) * pool.expert_bytes


def test_pool_takes_the_plain_weights_of_packed_experts(mixtral):
    """Experts prepacked (for the native kernel or oneDNN) go back to plain stacked weights the pool can move."""
    plain = blocks_of(load_model(str(mixtral), cpu_linear="torch").model)
    model = load_model(str(mixtral), cpu_linear="onednn").model
    if blocks_of(model)[0].packed_experts is None:
        pytest.skip("this torch has no oneDNN")
    pool = ExpertPool.attach(model, 2, costs=FAKE)
    for got, want in zip(blocks_of(model), plain):
        assert got.packed_experts is None and torch.equal(got.w_gate_up, want.w_gate_up)
        assert torch.equal(got.w_down, want.w_down)
    x = torch.randn(4, plain[0].w_gate_up.shape[-1])
    # the router stays prepacked: its logits may differ from torch's in the float32 summation order
    torch.testing.assert_close(blocks_of(model)[0](x), plain[0](x), rtol=1e-5, atol=1e-6)
    assert pool.stats.hits + pool.stats.loads + pool.stats.host_computed > 0


def test_one_token_runs_on_the_host_and_a_large_batch_is_loaded(mixtral):
    model = load_model(str(mixtral)).model
    block = blocks_of(model)[0]
    pool = ExpertPool.attach(model, 0, costs=FAKE, prefetch=False)  # no device slots at all
    block(torch.randn(1, block.w_gate_up.shape[-1]))
    assert (pool.stats.host_computed, pool.stats.loads, pool.stats.bytes_moved) == (2, 0, 0)
    block(torch.randn(64, block.w_gate_up.shape[-1]))  # ~16 tokens per expert: loaded (transient: no slots)
    assert pool.stats.loads >= 6 and pool.stats.bytes_moved == pool.stats.loads * pool.expert_bytes
    assert pool.resident(0) == frozenset()


PROMPTS = prompts(4, seed=3, min_len=1, max_len=60)
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)


def generate(llm: LLM):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def full_model_outputs(mixtral):
    return generate(LLM(str(mixtral)))


@pytest.mark.parametrize("budget", [0, 3])
def test_engine_outputs_equal_the_full_model(mixtral, full_model_outputs, budget):
    llm = LLM(str(mixtral), moe_resident_experts=budget)
    got = generate(llm)
    assert [g.token_ids for g in got] == [w.token_ids for w in full_model_outputs]
    for g, w in zip(got, full_model_outputs):
        for mine, ref in zip(g.logprobs, w.logprobs):
            assert mine == pytest.approx(ref, abs=1e-5)
    stats = llm.llm_engine.expert_pool.stats
    assert stats.hits + stats.loads + stats.host_computed > 0
    assert (stats.hits == 0) == (budget == 0)


def test_bad_budgets_and_models_are_refused(mixtral, tmp_path):
    with pytest.raises(ValueError, match=r"must be in \[0, 8\]"):
        LLM(str(mixtral), moe_resident_experts=9)
    with pytest.raises(ValueError, match="must be >= 0"):
        LLM(str(mixtral), moe_resident_experts=-1)
    dense = make_tiny_checkpoint(tmp_path / "dense")
    with pytest.raises(ValueError, match="no sparse layers"):
        LLM(str(dense), moe_resident_experts=2)
