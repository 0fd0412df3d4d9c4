"""The engine against HF transformers: greedy tokens equal, logprobs close, under every scheduling mode."""

import pytest
import torch

from ecoserve import LLM, SamplingParams
from tests.utils import hf_greedy, hf_logits, hf_logprobs, make_tiny_checkpoint, prompts

MAX_NEW = 32
LOGPROB_ATOL = 2e-3  # float32: batched/paged attention vs HF's dense attention differ by ~1e-5 typically


def mixed_prompts(seed=0):
    """8+ prompts from 1 to 300 tokens, two of them sharing a 200-token prefix with a third."""
    ps = prompts(6, seed=seed, min_len=1, max_len=300)
    ps[0] = ps[0][:1]
    shared = prompts(1, seed=seed + 1, min_len=200, max_len=200)[0]
    return ps + [shared + [40, 41], shared + [50], shared[:100]]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "model", request.param)
    ps = mixed_prompts()
    return path, ps, [hf_greedy(path, p, MAX_NEW) for p in ps]


MODES = {
    "chunked": dict(scheduling_policy="chunked"),
    "prefill_first": dict(scheduling_policy="prefill_first"),
    "chunked_small_budget": dict(scheduling_policy="chunked", max_num_batched_tokens=24),
    "preemption_chunked": dict(scheduling_policy="chunked", num_gpu_blocks=36, max_model_len=500,
                               max_num_batched_tokens=128),
    "preemption_prefill_first": dict(scheduling_policy="prefill_first", num_gpu_blocks=36, max_model_len=500),
    "no_prefix_cache_block8": dict(enable_prefix_caching=False, block_size=8),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf(checkpoint, mode):
    path, ps, refs = checkpoint
    llm = LLM(str(path), **MODES[mode])
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False)
    for p, out, ref in zip(ps, outs, refs):
        assert out.prompt_token_ids == p
        assert out.outputs[0].token_ids == ref, f"prompt of {len(p)} tokens diverged"
        assert out.outputs[0].finish_reason == ("stop" if len(ref) < MAX_NEW else "length")
    sched = llm.llm_engine.scheduler
    if mode.startswith("preemption"):
        assert sched.num_preemptions_total > 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    if mode == "chunked":
        # the shared 200-token prefix was served from the cache for the later prompts
        assert sched.kv.prefix_hits >= 192 + 96  # shared + [50] and shared[:100] hit in the same step
        again = llm.generate([{"prompt_token_ids": ps[-2]}], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                             use_tqdm=False)[0]
        assert again.num_cached_tokens >= 192 and again.outputs[0].token_ids == refs[-2]


def test_top_logprobs_close_to_hf(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    ps = prompts(4, seed=3, min_len=5, max_len=60)
    llm = LLM(str(path), max_num_batched_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True), use_tqdm=False)
    for p, out in zip(ps, outs):
        ref_tokens, ref_steps = hf_logprobs(path, p, 16, num_logprobs=5, ignore_eos=True)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        assert len(got.logprobs) == len(ref_steps)
        for mine, ref in zip(got.logprobs, ref_steps):
            assert set(mine) == set(ref)
            for tok, lp in ref.items():
                assert mine[tok] == pytest.approx(lp, abs=LOGPROB_ATOL)
        assert got.cumulative_logprob == pytest.approx(sum(s[t] for s, t in zip(ref_steps, ref_tokens)), abs=1e-2)


def test_prompt_logprobs_close_to_hf(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "qwen2")
    p = prompts(1, seed=5, min_len=50, max_len=50)[0]
    llm = LLM(str(path), max_num_batched_tokens=16)  # the prompt spans several chunks
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    ref = torch.log_softmax(hf_logits(path, p), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for i in range(1, len(p)):
        entry = out.prompt_logprobs[i]
        assert entry[p[i]] == pytest.approx(ref[i - 1, p[i]].item(), abs=LOGPROB_ATOL)
        assert len(entry) in (3, 4)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llm") / "m", "llama")
    return path, LLM(str(path), max_model_len=256)


def test_too_long_prompt_is_rejected_without_disturbing_the_batch(tiny_llm):
    path, llm = tiny_llm
    engine = llm.llm_engine
    good = prompts(2, seed=11, min_len=10, max_len=30)
    engine.add_request("a", {"prompt_token_ids": good[0]}, SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    with pytest.raises(ValueError, match=r"300 tokens, more than max_model_len \(256\)"):
        engine.add_request("bad", {"prompt_token_ids": [5] * 300}, SamplingParams())
    engine.add_request("b", {"prompt_token_ids": good[1]}, SamplingParams(temperature=0, max_tokens=8))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"a": hf_greedy(path, good[0], 8), "b": hf_greedy(path, good[1], 8)}
    with pytest.raises(ValueError, match="prompt 1: .*max_model_len"):
        llm.generate([{"prompt_token_ids": good[0]}, {"prompt_token_ids": [5] * 300}], use_tqdm=False)
    assert not engine.has_unfinished_requests()  # nothing half-queued
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([{"prompt_token_ids": [10**6]}], use_tqdm=False)


def test_generation_is_capped_at_max_model_len(tiny_llm):
    _, llm = tiny_llm
    out = llm.generate([{"prompt_token_ids": [7] * 250}], SamplingParams(max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_n_samples_seeded_and_reproducible(tiny_llm):
    _, llm = tiny_llm
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    a = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    b = llm.generate(["Once upon a time", "The weather was"], params, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_stop_strings_cut_the_text_and_min_tokens(tiny_llm):
    _, llm = tiny_llm
    prompt = "The quick brown fox"
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:text.index(stop) + len(stop)]


def test_stop_token_ids_and_offline_api_shapes(tiny_llm):
    _, llm = tiny_llm
    base = llm.generate("Hello, world!", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0]
    target = base.outputs[0].token_ids[4]
    first = base.outputs[0].token_ids.index(target)
    out = llm.generate("Hello, world!", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                       stop_token_ids=[target]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == base.outputs[0].token_ids[:first + 1]
    assert out.outputs[0].stop_reason == target and out.prompt == "Hello, world!"
    chat = llm.chat([{"role": "user", "content": "Why is the sky blue?"}],
                    SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert len(chat) == 1 and chat[0].outputs[0].token_ids


def test_default_sampling_params_come_from_generation_config(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama", generation_config={"temperature": 0.3, "top_p": 0.8,
                                                                           "top_k": 7, "do_sample": True})
    llm = LLM(str(path))
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.3, 0.8, 7)
    assert llm.generate("Hello", use_tqdm=False)[0].outputs[0].token_ids
