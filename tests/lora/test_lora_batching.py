"""Many adapters in one batch: each request's output equals the request run alone; slots and host cache
evict and reload without changing outputs; the prefix cache never crosses adapters."""

import pytest
import torch

from ecoserve import LLM, LoRARequest, SamplingParams
from ecoserve.lora import layers
from tests.lora.peft_refs import make_adapter
from tests.utils import make_tiny_checkpoint, prompts

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=1)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("batching")
    base = make_tiny_checkpoint(root / "model", "llama", num_layers=3)
    specs = [(8, ALL), (4, ("q_proj", "v_proj")), (16, ("gate_proj", "down_proj")), (8, ("o_proj", "up_proj"))]
    loras = [LoRARequest(f"ad{i}", i + 1, str(make_adapter(base, root / f"ad{i}", r=r, alpha=2 * r, targets=t,
                                                            seed=i)))
             for i, (r, t) in enumerate(specs)]
    return base, loras


def run(llm, jobs):
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs], GREEDY, use_tqdm=False,
                        lora_request=[lora for _, lora in jobs])
    return [(o.outputs[0].token_ids, [lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def alone(base, jobs):
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=16)
    return [run(llm, [job])[0] for job in jobs]


def assert_same(got, want):
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)


@pytest.mark.parametrize("path", ["native", "stacked", "per_slot"])
def test_four_adapters_and_base_in_one_batch_equal_each_alone(setup, path, monkeypatch):
    base, loras = setup
    ps = prompts(10, seed=3, min_len=3, max_len=50)
    # interleaved: the same adapter's rows are not contiguous (gathered segments) and base rows sit between
    order = [loras[0], None, loras[1], loras[2], loras[0], loras[3], None, loras[1], loras[3], loras[2]]
    jobs = list(zip(ps, order))
    if path == "native" and layers.native_sgmv(torch.float32, torch.device("cpu")) is None:
        pytest.skip("no native LoRA kernel here")
    if path != "native":  # the torch paths (a GPU's, or a CPU's without the kernel)
        monkeypatch.setattr(layers, "native_sgmv", lambda dtype, device: None)
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=16, max_num_batched_tokens=512)
    assert all((module.sgmv is not None) == (path == "native") for layer in llm.llm_engine.lora.wrapped
               for module in layer.values())
    if path == "per_slot":  # one GEMM pair per slot in every module, whatever the widths
        for layer in llm.llm_engine.lora.wrapped:
            for module in layer.values():
                module.stack_limit = 0
    assert_same(run(llm, jobs), alone(base, jobs))
    stats = llm.llm_engine.lora_stats()
    assert stats.max_lora == 4 and stats.num_slot_loads == 4 and stats.num_slot_evictions == 0
    assert stats.running_lora_adapters == [] and stats.waiting_lora_adapters == []


def test_evicted_and_reloaded_adapters_keep_outputs(setup):
    base, loras = setup
    ps = prompts(12, seed=4, min_len=3, max_len=30)
    jobs = [(p, loras[i % 4]) for i, p in enumerate(ps)]
    # two slots and two host entries for four adapters: slots and host memory are reused all run long
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16, max_num_seqs=3)
    got = run(llm, jobs)
    again = run(llm, jobs[:4])  # reloaded from disk after eviction
    want = alone(base, jobs)
    assert_same(got, want)
    assert_same(again, want[:4])
    stats = llm.llm_engine.lora_stats()
    assert stats.num_slot_evictions > 0 and stats.num_evictions > 0
    assert stats.num_loads > 4  # read from disk again after leaving the host cache


def test_prefix_cache_is_not_shared_across_adapters(setup):
    base, loras = setup
    prompt = prompts(1, seed=9, min_len=70, max_len=70)[0]
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, block_size=16)

    def cached(lora):
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=lora)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first_a, tokens_a = cached(loras[0])
    assert first_a == 0
    assert cached(loras[1])[0] == 0  # same tokens, another adapter: no hit
    assert cached(None)[0] == 0  # the base model neither
    hit_a, again_a = cached(loras[0])
    assert hit_a == 64 and again_a == tokens_a  # the same adapter hits its own blocks
    assert cached(None)[0] == 64


def test_bfloat16_native_batch_equals_the_torch_path(setup, monkeypatch):
    """In bfloat16 the native kernel rounds as the torch path does (the shrink once, the sum once): the same
    greedy tokens and logprobs within bf16's rounding, for a batch of four adapters and base requests."""
    if layers.native_sgmv(torch.bfloat16, torch.device("cpu")) is None:
        pytest.skip("no native bfloat16 LoRA kernel here (it needs AMX)")
    base, loras = setup
    ps = prompts(8, seed=5, min_len=3, max_len=40)
    jobs = list(zip(ps, [loras[0], loras[1], None, loras[2], loras[3], loras[0], None, loras[2]]))

    def outputs():
        llm = LLM(str(base), dtype="bfloat16", enable_lora=True, max_loras=4, max_lora_rank=16)
        return run(llm, jobs)

    native = outputs()
    monkeypatch.setattr(layers, "native_sgmv", lambda dtype, device: None)
    torch_path = outputs()
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(native, torch_path):
        agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        assert agree >= 4  # a near-tie may flip later, after rounding differences accumulate
        assert logprobs[:agree] == pytest.approx(ref_logprobs[:agree], abs=0.1)
