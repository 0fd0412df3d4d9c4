"""Bad adapters fail at load time with a clear error, nothing is queued, and the engine keeps serving."""
import json
import shutil

import pytest

from ecoserve import LLM, LoRARequest, SamplingParams
from ecoserve.lora import LoRAAdapterError
from tests.lora.peft_refs import make_adapter, peft_greedy
from tests.utils import make_tiny_checkpoint, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    base = make_tiny_checkpoint(root / "model", "llama")
    good = make_adapter(base, root / "good", r=8)
    bad = {}
    bad["rank"] = (make_adapter(base, root / "rank32", r=32), "rank 32 is above --max-lora-rank 16")
    no_weights = root / "no_weights"
    shutil.copytree(good, no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    bad["missing file"] = (no_weights, "adapter_model.safetensors is missing")
    bad["missing dir"] = (root / "nowhere", "no such directory")
    lacking = root / "lacking"
    shutil.copytree(good, lacking)
    config = json.loads((lacking / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "c_attn"]
    (lacking / "adapter_config.json").write_text(json.dumps(config))
    bad["lacking target"] = (lacking, "targets modules this model lacks")
    bad["head target"] = (make_adapter(base, root / "head", targets=("lm_head",)), "lm_head")
    other = make_tiny_checkpoint(root / "other", "llama", hidden_size=32, head_dim=8)
    bad["other base"] = (make_adapter(other, root / "other_adapter"), "trained for another base model")
    broken = root / "broken"
    shutil.copytree(good, broken)
    (broken / "adapter_config.json").write_text("{not json")
    bad["bad json"] = (broken, "not valid JSON")
    dora = root / "dora"
    shutil.copytree(good, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    config["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(config))
    bad["dora"] = (dora, "DoRA")
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16)
    return base, LoRARequest("good", 1, str(good)), bad, llm


@pytest.mark.parametrize("case", ["rank", "missing file", "missing dir", "lacking target", "head target",
                                  "other base", "bad json", "dora", "base name"])
def test_bad_adapter_errors_clearly_and_engine_keeps_serving(setup, case):
    base, good, bad, llm = setup
    if case == "base name":
        lora, message = LoRARequest("named", 9, good.lora_path, base_model_name="someone/else"), "its base model"
    else:
        path, message = bad[case]
        lora = LoRARequest(f"bad-{case}", 9, str(path))
    engine = llm.llm_engine
    with pytest.raises(LoRAAdapterError, match=message):
        engine.add_lora(lora)
    with pytest.raises(ValueError, match=message):  # a request naming it is refused, nothing is queued
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, GREEDY, use_tqdm=False, lora_request=[None, lora])
    assert not engine.has_unfinished_requests()
    assert all(r.lora_name != lora.lora_name for r in engine.list_loras())
    p = prompts(1, seed=1)[0]
    outs = llm.generate([{"prompt_token_ids": p}] * 2, GREEDY, use_tqdm=False, lora_request=[good, None])
    assert outs[0].outputs[0].token_ids == peft_greedy(base, good.lora_path, p, 6)[0]


def test_registration_rules(setup):
    base, good, bad, llm = setup
    engine = llm.llm_engine
    engine.add_lora(good)
    engine.add_lora(good)  # the same adapter again: nothing changes
    assert engine.list_loras() == [good]
    with pytest.raises(LoRAAdapterError, match="already registered"):
        engine.add_lora(LoRARequest("good", 1, str(bad["rank"][0])))
    with pytest.raises(LoRAAdapterError, match="already used by adapter 'good'"):
        engine.add_lora(LoRARequest("twin", 1, good.lora_path))
    assert engine.remove_lora("good") and not engine.remove_lora("good")
    assert engine.list_loras() == []
    p = prompts(1, seed=2)[0]  # a request registers its adapter again on first use
    out = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False, lora_request=good)[0]
    assert out.outputs[0].token_ids == peft_greedy(base, good.lora_path, p, 6)[0]
    assert engine.list_loras() == [good]


def test_lora_off_or_parallel_is_refused(setup):
    base, good, _, _ = setup
    plain = LLM(str(base))
    with pytest.raises(ValueError, match="not enabled"):
        plain.generate([{"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False, lora_request=good)
    assert plain.llm_engine.list_loras() == [] and plain.llm_engine.lora_stats().max_lora == 0
    with pytest.raises(ValueError, match="single-process"):
        LLM(str(base), enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(base), enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_adapter_broken_after_registration_fails_its_requests_alone(setup, tmp_path):
    base, good, _, llm = setup
    fragile = tmp_path / "fragile"
    shutil.copytree(good.lora_path, fragile)
    lora = LoRARequest("fragile", 7, str(fragile))
    engine = llm.llm_engine
    p = prompts(1, seed=3)[0]
    engine.add_request("broken", {"prompt_token_ids": p}, GREEDY, lora_request=lora)  # validated: header read
    (fragile / "adapter_model.safetensors").write_bytes(b"\0" * 64)  # its weights break before they are read
    engine.add_request("good", {"prompt_token_ids": p}, GREEDY, lora_request=good)
    engine.add_request("base", {"prompt_token_ids": p}, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    failed = engine.take_failed()
    assert set(failed) == {"broken"} and "could not be loaded" in str(failed["broken"])
    assert done["good"] == peft_greedy(base, good.lora_path, p, 6)[0]
    assert set(done) == {"good", "base"}
    assert all(r.lora_name != "fragile" for r in engine.list_loras())
