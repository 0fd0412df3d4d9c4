"""Greedy tokens and logprobs with LoRA adapters equal HF + peft (PeftModel and the merged model)."""

import pytest

from ecoserve import LLM, LoRARequest, SamplingParams
from tests.lora.peft_refs import make_adapter, peft_greedy
from tests.utils import make_tiny_checkpoint, prompts

MAX_NEW = 16
LOGPROB_ATOL = 2e-3

# name -> (r, alpha, target modules, rsLoRA): unfused subsets, whole fused modules, several ranks
ADAPTERS = {
    "qv_r4": (4, 8, ("q_proj", "v_proj"), False),
    "all_r8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "mlp_r16_rslora": (16, 8, ("gate_proj", "up_proj", "down_proj"), True),
    "ko_r2": (2, 4, ("k_proj", "o_proj", "up_proj"), False),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = make_tiny_checkpoint(root / "model", request.param)
    adapters = {}
    for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        path = make_adapter(base, root / name, r=r, alpha=alpha, targets=targets, use_rslora=rslora, seed=i)
        adapters[name] = LoRARequest(name, i + 1, str(path))
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=16)
    return base, adapters, llm


def test_each_adapter_matches_peft_and_merged(setup):
    base, adapters, llm = setup
    ps = prompts(3, seed=5, min_len=4, max_len=40)
    names = list(adapters)
    jobs = [(p, names[(i + k) % len(names)]) for k, p in enumerate(ps) for i in range(len(names))]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in jobs],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=1), use_tqdm=False,
                        lora_request=[adapters[n] for _, n in jobs])
    changed = 0
    for (p, name), out in zip(jobs, outs):
        path = adapters[name].lora_path
        ref_tokens, ref_logprobs = peft_greedy(base, path, p, MAX_NEW)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"adapter {name} diverged from PeftModel"
        assert got.token_ids == peft_greedy(base, path, p, MAX_NEW, merged=True)[0], f"{name}: merged model"
        for t, lp, ref in zip(got.token_ids, got.logprobs, ref_logprobs):
            assert lp[t] == pytest.approx(ref, abs=LOGPROB_ATOL)
        base_out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                                use_tqdm=False)[0]
        changed += base_out.outputs[0].token_ids != got.token_ids
    assert changed >= len(jobs) // 2, "the adapters barely change outputs: the test would not see a wrong delta"
