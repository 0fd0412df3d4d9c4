"""Layer-wise loading: a step starts before a cold adapter is resident and each layer waits only for its own
weights; the adapters of waiting requests are prefetched while other requests run."""
import threading
import time

import pytest

from ecoserve import LLM, LoRARequest, SamplingParams
from tests.lora.peft_refs import make_adapter, peft_greedy
from tests.utils import make_tiny_checkpoint, prompts

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_LAYERS = 4
LAYER_DELAY_S = 0.1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    base = make_tiny_checkpoint(root / "model", "llama", num_layers=NUM_LAYERS)
    loras = [LoRARequest(f"ad{i}", i + 1, str(make_adapter(base, root / f"ad{i}", targets=ALL, seed=i)))
             for i in range(2)]
    return base, loras


def traced_llm(base, events, **kwargs):
    """An engine whose loader sleeps before each layer; `events` gets (what, layer, adapter id or None): "load"
    as a layer's load starts, "compute" once the layer's qkv projection (with its LoRA) has run."""
    llm = LLM(str(base), enable_lora=True, max_lora_rank=16, **kwargs)
    engine = llm.llm_engine
    lock = threading.Lock()

    def slow(job, layer):
        time.sleep(LAYER_DELAY_S)
        with lock:
            events.append(("load", layer, job.host.lora.lora_int_id))

    engine.lora.loader.before_layer = slow
    for i, layer in enumerate(engine.loaded.model.layers):
        def computed(module, args, output, i=i):  # the layer's first LoRA module is done
            with lock:
                events.append(("compute", i, None))
        layer.self_attn.qkv_proj.register_forward_hook(computed)
    return llm


@pytest.mark.parametrize("layerwise", [True, False])
def test_steps_run_while_later_layers_load(setup, layerwise):
    base, (lora, _) = setup
    events = []
    llm = traced_llm(base, events)
    llm.llm_engine.lora.layerwise = layerwise
    prompt = prompts(1, seed=2, min_len=12, max_len=12)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False,
                       lora_request=lora)[0]
    assert out.outputs[0].token_ids == peft_greedy(base, lora.lora_path, prompt, 6)[0]
    first_compute = events.index(("compute", 0, None))
    last_load = events.index(("load", NUM_LAYERS - 1, 1))
    if layerwise:
        assert first_compute < last_load, f"the step waited for the whole adapter: {events}"
        for layer in range(NUM_LAYERS):  # yet no layer computed before its own weights arrived
            assert events.index(("load", layer, 1)) < events.index(("compute", layer, None))
    else:
        assert first_compute > last_load


def test_waiting_requests_adapters_are_prefetched(setup):
    base, (a, b) = setup
    events = []
    llm = traced_llm(base, events, max_loras=2, max_num_seqs=1)
    engine = llm.llm_engine
    waiting_when_loaded = []
    slow = engine.lora.loader.before_layer

    def record(job, layer):
        if job.host.lora == b and layer == 0:
            waiting_when_loaded.append(any(r.lora_request == b for r in engine.scheduler.waiting))
        slow(job, layer)

    engine.lora.loader.before_layer = record
    ps = prompts(2, seed=6, min_len=5, max_len=10)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False, lora_request=[a, b])
    assert waiting_when_loaded == [True]  # b's adapter started loading while its request still waited
    for p, lora, out in zip(ps, (a, b), outs):
        assert out.outputs[0].token_ids == peft_greedy(base, lora.lora_path, p, 8)[0]
    assert engine.lora_stats().num_slot_loads == 2
