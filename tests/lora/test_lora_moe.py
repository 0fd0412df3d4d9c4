"""LoRA on a mixture-of-experts model: adapters on the attention projections equal HF + peft; an adapter of
the routed experts' MLP projections is refused at load time, and the engine keeps serving."""

import pytest

from ecoserve import LLM, LoRARequest, SamplingParams
from ecoserve.lora import LoRAAdapterError
from tests.lora.peft_refs import make_adapter, peft_greedy
from tests.utils import make_tiny_moe_checkpoint, prompts

MAX_NEW = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe")
    base = make_tiny_moe_checkpoint(root / "model", "qwen3_moe")
    attn = make_adapter(base, root / "attn", r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    mlp = make_adapter(base, root / "mlp", r=8, alpha=16, targets=("q_proj", "down_proj"), seed=1)
    return base, attn, mlp, LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8)


def test_attention_adapter_on_moe_matches_peft(setup):
    base, attn, _, llm = setup
    lora = LoRARequest("attn", 1, str(attn))
    ps = prompts(3, seed=11, min_len=4, max_len=30)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False, lora_request=[lora, None, lora])
    plain = llm.generate([{"prompt_token_ids": ps[0]}], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == peft_greedy(base, attn, ps[0], MAX_NEW)[0]
    assert outs[2].outputs[0].token_ids == peft_greedy(base, attn, ps[2], MAX_NEW)[0]
    assert outs[0].outputs[0].token_ids != plain, "the adapter changes nothing: the test would not see it"


def test_expert_mlp_adapter_is_refused_and_engine_serves_on(setup):
    _, attn, mlp, llm = setup
    with pytest.raises(LoRAAdapterError, match="does not adapt"):
        llm.llm_engine.add_lora(LoRARequest("mlp", 2, str(mlp)))
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False, lora_request=LoRARequest("attn", 1, str(attn)))
    assert len(out[0].outputs[0].token_ids) == 4
