"""Speculation and LoRA adapters together: requests with and without an adapter verify their proposals through
their own adapter, and greedy outputs equal the engine without speculation."""

from ecoserve import LLM, LoRARequest, SamplingParams
from tests.lora.peft_refs import make_adapter
from tests.utils import make_tiny_checkpoint, prompts


def test_ngram_with_adapters_equals_plain_greedy(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "m", "llama")
    lora = LoRARequest("a", 1, str(make_adapter(base, tmp_path / "a", targets=("q_proj", "v_proj", "down_proj"))))
    ps = [p * 3 for p in prompts(3, seed=3, min_len=4, max_len=10)]  # repeated text: n-gram lookup finds it
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                        "prompt_lookup_min": 1}):
        llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8,
                  **({"speculative_config": spec} if spec else {}))
        got = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False,
                           lora_request=[lora, None, lora])
        outs.append([o.outputs[0].token_ids for o in got])
        if spec:
            assert llm.llm_engine.speculator.counters.num_accepted_tokens > 0, "nothing was speculated"
    assert outs[0] == outs[1]
