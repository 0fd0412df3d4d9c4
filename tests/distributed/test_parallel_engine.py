"""TP and PP engines over worker processes (gloo, 2 ranks, one thread each) against the single-process engine.

A mixed batch (1-300 token prompts) runs with chunked prefill and a KV pool small enough to force
preemption; greedy tokens must be equal and the sampled tokens' logprobs within LOGPROB_ATOL
(float32: the TP all-reduce sums partial matmuls in another order, ~1e-6 apart).
"""
import pytest

from ecoserve import LLM, SamplingParams
from tests.utils import make_tiny_checkpoint, prompts

MAX_NEW = 12
LOGPROB_ATOL = 1e-4
# 64-token steps chunk every long prompt; 40 blocks of 16 cannot hold all ten requests at once
TIGHT = dict(num_threads=1, max_num_batched_tokens=64, num_gpu_blocks=40, max_model_len=320, step_timeout_s=60)


def mixed_prompts():
    ps = prompts(9, seed=3, min_len=1, max_len=300)
    return [ps[0][:1]] + ps[1:] + [prompts(1, seed=4, min_len=290, max_len=300)[0]]


def run(path, **kwargs):
    llm = LLM(str(path), **{**TIGHT, **kwargs})
    try:
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=1, temperature=0.0)  # greedy
        outs = llm.generate([{"prompt_token_ids": p} for p in mixed_prompts()], params, use_tqdm=False)
        preemptions = llm.llm_engine.scheduler.num_preemptions_total
    finally:
        llm.llm_engine.shutdown()
    return [o.outputs[0] for o in outs], preemptions


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for lg, lw, tok in zip(g.logprobs, w.logprobs, w.token_ids):
            assert abs(lg[tok] - lw[tok]) < LOGPROB_ATOL


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("par") / "llama", num_layers=4)
    reference, preemptions = run(path)
    assert preemptions > 0, "the KV pool must be small enough to force preemption"
    return path, reference


@pytest.mark.parametrize("kwargs", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2, pp_layer_partition="3,1")],
                         ids=["tp2", "pp2-3,1"])  # PP runs 2 batches in flight by default; plain pp2: see below
def test_parallel_equals_single_engine(llama, kwargs):
    path, reference = llama
    got, preemptions = run(path, **kwargs)
    assert preemptions > 0
    assert_same(got, reference)


@pytest.mark.parametrize("arch,overrides,kwargs", [
    ("qwen2", dict(num_key_value_heads=1), dict(tensor_parallel_size=2)),  # GQA: tp > KV heads; qkv bias
    ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
     dict(tensor_parallel_size=2, pipeline_parallel_size=2)),  # tied head on another stage; row biases once
], ids=["gqa-tp2-over-kv-heads", "tied-tp2-pp2"])
def test_model_variants(tmp_path, arch, overrides, kwargs):
    path = make_tiny_checkpoint(tmp_path / arch, arch, num_layers=2, **overrides)
    reference, _ = run(path)
    got, _ = run(path, **kwargs)
    assert_same(got, reference)


class SubmitLog:
    """Wraps an executor's submit: records which requests each batch in flight holds."""

    def __init__(self, engine) -> None:
        self.engine, self.submit = engine, engine.executor.submit
        self.max_in_flight, self.overlaps = 0, []
        engine.executor.submit = self

    def __call__(self, batch, masks=None):
        ids = {c.request.request_id for c in batch.chunks}
        for other, _ in self.engine._in_flight:
            self.overlaps += ids & {c.request.request_id for c in other.chunks}
        self.max_in_flight = max(self.max_in_flight, len(self.engine._in_flight) + 1)
        return self.submit(batch, masks)


def streams(path, max_concurrent_batches):
    """Greedy and seeded-sampled requests on PP=2; each request's token deltas in the order they streamed."""
    llm = LLM(str(path), **{**TIGHT, "pipeline_parallel_size": 2, "max_concurrent_batches": max_concurrent_batches})
    engine = llm.llm_engine
    log = SubmitLog(engine)
    try:
        for i, p in enumerate(mixed_prompts()):
            params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        deltas = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                deltas.setdefault(out.request_id, []).append(list(out.outputs[0].new_token_ids))
        preemptions = engine.scheduler.num_preemptions_total
    finally:
        engine.shutdown()
    return deltas, log, preemptions


def test_two_batches_in_flight_equal_one(llama):
    """PP=2: with 2 batches in flight no request is in two at once, and the streams equal 1 in flight's."""
    path, reference = llama
    one, log1, _ = streams(path, 1)
    two, log2, preemptions = streams(path, 2)
    assert log1.max_in_flight == 1 and log2.max_in_flight == 2
    assert log2.overlaps == [], "a request was in two batches in flight at once"
    assert preemptions > 0
    assert two == one  # every request's deltas, in the order they streamed
    assert [sum(two[str(i)], []) for i in range(0, len(reference), 2)] == [o.token_ids for o in reference[::2]]


def test_tdpipe_on_pp2_equals_single_engine(llama):
    """The tdpipe policy on a real PP=2 engine: it plans with the engine's 2 stages; greedy tokens unchanged."""
    path, reference = llama
    llm = LLM(str(path), **{**TIGHT, "pipeline_parallel_size": 2, "scheduling_policy": "tdpipe"})
    try:
        assert llm.llm_engine.scheduler.config.tdpipe.num_stages == 2
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=1, temperature=0.0)
        outs = llm.generate([{"prompt_token_ids": p} for p in mixed_prompts()], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert_same([o.outputs[0] for o in outs], reference)


def test_pp2_bf16_model_with_float32_cache_equals_single_engine(llama):
    """A bfloat16 pipeline (no all-reduce: the same bf16 ops as one process) with a float32 cache gives the single
    bfloat16 engine's tokens, and sizes its block pool with float32 K/V."""
    path, _ = llama
    bf16 = dict(dtype="bfloat16", kv_cache_dtype="float32", cpu_linear="torch")  # the ranks run F.linear
    reference, _ = run(path, **bf16)
    got, _ = run(path, pipeline_parallel_size=2, max_concurrent_batches=1, **bf16)
    assert_same(got, reference)
    engine = LLM(str(path), pipeline_parallel_size=2, num_gpu_blocks=40, max_model_len=320, **bf16).llm_engine
    try:
        assert engine.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4  # 2 of 4 layers, K and V, 2 heads x 16, float32
    finally:
        engine.shutdown()
