"""Speculative decoding through the engine: greedy outputs equal non-speculative ones token for token (ngram,
a random draft model, the GGUF self-draft), whatever stops them, with prefix caching and preemption; requests
with and without proposals share steps; grammars hold; the counters count."""
import math
import re

import pytest
import torch
from gguf import GGMLQuantizationType

from ecoserve import LLM, SamplingParams
from ecoserve.engine.spec_decode.length import FixedLength, LengthQuery
from ecoserve.structured import StructuredOutputsParams
from tests.utils import make_tiny_checkpoint, make_tiny_gguf, prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
COMMON = dict(num_threads=1, max_model_len=256, num_gpu_blocks=96, block_size=8)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = make_tiny_checkpoint(root / "target", "llama")
    draft = make_tiny_checkpoint(root / "draft", "llama", num_layers=1, seed=7)
    self_draft = make_tiny_gguf(target, root / "target-q8.gguf", GGMLQuantizationType.Q8_0)
    return {"target": str(target), "draft": str(draft), "self_draft": str(self_draft)}


def workload() -> list[list[int]]:
    """Prompts that repeat themselves (what prompt lookup feeds on) and prompts that do not."""
    repeated = [p * 3 for p in prompts(3, seed=5, min_len=4, max_len=9)]
    return repeated + prompts(3, seed=6, min_len=3, max_len=30)


def generate(llm: LLM, token_prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def base(paths):
    return LLM(paths["target"], **COMMON)


@pytest.fixture(scope="module")
def ngram(paths):
    return LLM(paths["target"], speculative_config=NGRAM, **COMMON)


GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.mark.parametrize("which", ["ngram", "draft", "self_draft"])
def test_greedy_equals_non_speculative_greedy(paths, base, which):
    config = {"ngram": NGRAM,
              "draft": {"method": "draft_model", "model": paths["draft"], "num_speculative_tokens": 4},
              "self_draft": {"method": "draft_model", "model": paths["self_draft"], "quantization": "gguf",
                             "num_speculative_tokens": 3}}[which]
    llm = LLM(paths["target"], speculative_config=config, **COMMON)
    assert generate(llm, workload(), GREEDY) == generate(base, workload(), GREEDY)
    counters = llm.llm_engine.speculator.counters
    assert counters.num_drafts > 0 and counters.num_draft_tokens >= counters.num_drafts
    if which != "draft":  # prompt lookup on repeats and a Q8_0 copy of the target both guess right often
        assert counters.num_accepted_tokens > counters.num_drafts // 4


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8])
def test_max_tokens_cut_mid_proposal(base, ngram, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    got = generate(ngram, workload(), params)
    assert got == generate(base, workload(), params)
    assert all(len(t) == max_tokens for t in got)


def test_eos_inside_a_proposal_ends_the_output_there(base, ngram):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = generate(base, workload()[:1], params)[0]
    eos = reference[12]  # a token the output reaches mid-way, made the end-of-sequence token
    for llm in (base, ngram):
        llm.llm_engine.eos_token_ids = frozenset({eos})
    try:
        want = generate(base, workload()[:1], GREEDY)
        got = generate(ngram, workload()[:1], GREEDY)
    finally:
        for llm in (base, ngram):
            llm.llm_engine.eos_token_ids = frozenset(llm.llm_engine.loaded.eos_token_ids)
    assert got == want and got[0][-1] == eos and len(got[0]) == reference.index(eos) + 1


def test_stop_strings_emit_nothing_past_the_stop(base, ngram):
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = base.generate([{"prompt_token_ids": workload()[0]}], free, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    want = base.generate([{"prompt_token_ids": workload()[0]}], params, use_tqdm=False)[0].outputs[0]
    got = ngram.generate([{"prompt_token_ids": workload()[0]}], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert stop not in got.text


def test_prefix_caching_indexes_only_accepted_tokens(base, ngram):
    """A second request over the first one's prompt and output hits its blocks and still decodes the same."""
    first = workload()[0]
    out = generate(ngram, [first], GREEDY)[0]
    follow_up = first + out + first[:5]
    hits = ngram.llm_engine.scheduler.kv.prefix_hits
    assert generate(ngram, [follow_up], GREEDY) == generate(base, [follow_up], GREEDY)
    assert ngram.llm_engine.scheduler.kv.prefix_hits > hits


def test_preemption_recomputes_and_keeps_outputs(paths):
    small = dict(COMMON, num_gpu_blocks=34, max_num_seqs=6)
    base = LLM(paths["target"], **small)
    spec = LLM(paths["target"], speculative_config=NGRAM, **small)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert generate(spec, workload(), params) == generate(base, workload(), params)
    assert spec.llm_engine.scheduler.num_preemptions_total > 0


class ByRequest:
    """k by request id: speculating and not, with different lengths, in the same steps."""

    def __init__(self, ks: dict[str, int]) -> None:
        self.ks = ks

    def choose(self, query: LengthQuery) -> int:
        return min(self.ks.get(query.request_id, 0), query.max_tokens)


def run_engine(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Add the requests under their own ids in one go and step until all are done: their final outputs."""
    engine = llm.llm_engine
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done


def test_mixed_batch_gives_each_request_its_alone_output(paths, base):
    llm = LLM(paths["target"], speculative_config=dict(NGRAM, num_speculative_tokens=5), **COMMON)
    params = [SamplingParams(temperature=0, max_tokens=30),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=30, presence_penalty=0.5),
              SamplingParams(temperature=1.0, seed=4, top_k=20, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=30, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30)]
    requests = {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(workload(), params))}
    llm.llm_engine.speculator.length = ByRequest({f"r{i}": i % 3 * 2 for i in range(len(params))})  # 0, 2, 4
    alone = {}
    for rid, request in requests.items():
        alone.update(run_engine(llm, {rid: request}))
    together = run_engine(llm, requests)
    assert {rid: o.token_ids for rid, o in together.items()} == {rid: o.token_ids for rid, o in alone.items()}
    assert llm.llm_engine.speculator.counters.num_drafts > 0
    for rid in ("r0", "r2", "r4", "r5"):  # greedy ones also equal the engine without speculation
        want = run_engine(base, {rid: requests[rid]})[rid]
        assert together[rid].token_ids == want.token_ids
    for got, want in zip(together["r4"].logprobs, run_engine(base, {"r4": requests["r4"]})["r4"].logprobs):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-4 for t in got)


def test_structured_outputs_never_break_the_grammar(paths, base):
    llm = LLM(paths["target"], speculative_config=dict(NGRAM, num_speculative_tokens=4), **COMMON)
    regex = r"(ab|cd|the ){2,8}-[0-9]{2}"
    spec = StructuredOutputsParams(regex=regex)
    # prompts full of text the grammar takes, so prompt lookup proposes tokens it must check position by position
    texts = ["abcdab-12 the the abcd-34 cdab-56 the ab", "the cd the ab-78 cdcd-90 the"] * 4
    ps = [{"prompt": t} for t in texts]
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=spec) for s in range(8)]
    outs = llm.generate(ps, sampled, use_tqdm=False)
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs)
    assert llm.llm_engine.speculator.counters.num_draft_tokens > 0
    greedy = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    want = [o.outputs[0].text for o in base.generate(ps[:2], greedy, use_tqdm=False)]
    assert [o.outputs[0].text for o in llm.generate(ps[:2], greedy, use_tqdm=False)] == want
    assert all(re.fullmatch(regex, t) for t in want)


def test_draft_model_sampling_is_seeded_and_counted(paths):
    config = {"method": "draft_model", "model": paths["self_draft"], "quantization": "gguf",
              "num_speculative_tokens": 3}
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=24, ignore_eos=True) for s in range(4)]
    runs = []
    for _ in range(2):
        llm = LLM(paths["target"], speculative_config=config, **COMMON)
        runs.append(generate(llm, workload()[:4], params))
        counters = llm.llm_engine.speculator.counters
        assert counters.num_accepted_tokens > counters.num_drafts // 4  # a Q8_0 copy agrees with its target
    assert runs[0] == runs[1] and all(len(t) == 24 for t in runs[0])


def test_counters_reach_metrics(ngram):
    from ecoserve.engine.async_engine import SchedulerCollector

    generate(ngram, workload()[:2], GREEDY)
    families = {m.name: m for m in SchedulerCollector(ngram.llm_engine, "m", "vllm:").collect()}
    counters = ngram.llm_engine.speculator.counters
    assert families["vllm:spec_decode_num_drafts"].samples[0].value == counters.num_drafts > 0
    assert families["vllm:spec_decode_num_accepted_tokens"].samples[0].value == counters.num_accepted_tokens
    per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [s.labels["position"] for s in per_pos] == ["0", "1", "2"]
    assert sum(s.value for s in per_pos) == counters.num_accepted_tokens


def test_what_speculation_cannot_run_is_refused(paths):
    with pytest.raises(ValueError, match="pipeline_parallel_size 2"):
        LLM(paths["target"], speculative_config=NGRAM, pipeline_parallel_size=2, **COMMON)
    with pytest.raises(ValueError, match="JSON"):
        LLM(paths["target"], speculative_config="{method: ngram}", **COMMON)
    with pytest.raises(ValueError, match="unknown speculative_config key"):
        LLM(paths["target"], speculative_config={"method": "ngram", "k": 3}, **COMMON)
    with pytest.raises(ValueError, match="needs a model"):
        LLM(paths["target"], speculative_config={"method": "draft_model"}, **COMMON)
    other = make_tiny_checkpoint(paths["draft"] + "-vocab", "llama", num_layers=1, vocab_size=600)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(paths["target"], speculative_config={"method": "draft_model", "model": str(other)}, **COMMON)



@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_engine_samples_follow_the_target_distribution(tmp_path, method):
    """Through the whole engine (batched verification, KV roll-back): with a 16-token vocabulary, the token after
    the likeliest first one follows the target's probabilities (Pearson's test; a wrong rule fails it, see
    test_spec_verify.py)."""
    from tests.engine.spec_decode.test_spec_verify import chi_square_p

    vocab = 16
    target = make_tiny_checkpoint(tmp_path / "t", "llama", vocab_size=vocab, initializer_range=0.05)
    draft = make_tiny_checkpoint(tmp_path / "d", "llama", num_layers=1, vocab_size=vocab, seed=3,
                                 initializer_range=0.05)
    options = dict(COMMON, skip_tokenizer_init=True, max_num_seqs=256, num_gpu_blocks=2048)
    config = NGRAM if method == "ngram" else {"method": "draft_model", "model": str(draft),
                                              "num_speculative_tokens": 3}
    prompt = list(range(vocab)) + [3, 4, 5]  # every token occurs: lookup proposes after any first token
    base = LLM(str(target), **options)
    first = base.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, logprobs=vocab),
                          use_tqdm=False)[0].outputs[0].logprobs[0]
    mode = max(first, key=first.get)
    nxt = base.generate([{"prompt_token_ids": prompt + [mode]}], SamplingParams(max_tokens=1, logprobs=vocab),
                        use_tqdm=False)[0].outputs[0].logprobs[0]
    target_p = torch.tensor([math.exp(nxt[t]) for t in range(vocab)], dtype=torch.float64)
    llm = LLM(str(target), speculative_config=config, **options)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(3000)]
    outs = generate(llm, [prompt] * len(params), params)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for tokens in outs:
        if tokens[0] == mode:
            counts[tokens[1]] += 1
    assert counts.sum() > 300 and llm.llm_engine.speculator.counters.num_accepted_tokens > 0
    assert chi_square_p(counts, target_p / target_p.sum()) > 1e-3


def test_n_samples_each_speculate_as_their_own_request(ngram):
    from ecoserve.engine.llm_engine import sample_seed

    prompt = {"prompt_token_ids": workload()[0]}
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    together = ngram.generate([prompt], params, use_tqdm=False)[0].outputs
    alone = [ngram.generate([prompt], params.clone(n=1, seed=sample_seed(5, i)), use_tqdm=False)[0].outputs[0]
             for i in range(3)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 20 for o in together)
