"""Guided decoding on a tiny random model: every sample matches its constraint, unconstrained rows are untouched."""
import json
import re

import jsonschema
import pytest

from ecoserve import LLM, SamplingParams
from ecoserve.structured import StructuredOutputsParams
from tests.utils import make_tiny_checkpoint, prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                   "vip": {"type": "boolean"}},
                  "required": ["city", "vip"], "additionalProperties": False},
    },
    "required": ["name", "kind", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ["red", "green", "blue", "light blue"]
NUM_SAMPLES = 20


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("guided") / "tiny", "llama")
    return LLM(str(path), num_threads=1, max_model_len=512, max_num_seqs=32)


def sample(llm, spec, n=NUM_SAMPLES, max_tokens=200, **kw):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=spec, **kw)
              for s in range(n)]
    ps = [{"prompt_token_ids": p} for p in prompts(n, seed=3)]
    return [o.outputs[0] for o in llm.generate(ps, params, use_tqdm=False)]


def test_json_schema_samples_validate(llm):
    for out in sample(llm, StructuredOutputsParams(json=SCHEMA)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_regex_choice_grammar(llm):
    # Any-JSON strings are unbounded, so a random model often runs out of tokens: then the text is a valid prefix.
    spec = StructuredOutputsParams(json_object=True)
    outs = sample(llm, spec, n=6)
    assert any(out.finish_reason == "stop" for out in outs)
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        assert llm.llm_engine.guided.compiler.compile(spec).deep_copy().consume_tokens(out.token_ids)
    for out in sample(llm, StructuredOutputsParams(regex=REGEX)):
        assert re.fullmatch(REGEX, out.text), out.text
    for out in sample(llm, StructuredOutputsParams(choice=CHOICES)):
        assert out.text in CHOICES and out.finish_reason == "stop"
    lark = 'start: ("yes" | "no") ", " NUM\nNUM: /[0-9]{1,3}/'
    for out in sample(llm, StructuredOutputsParams(grammar=lark), n=8):
        assert re.fullmatch(r"(yes|no), [0-9]{1,3}", out.text), out.text
    gbnf = 'root ::= "x" [0-9] [0-9]? "!"'
    for out in sample(llm, StructuredOutputsParams(grammar=gbnf), n=8):
        assert re.fullmatch(r"x[0-9][0-9]?!", out.text), out.text


def test_unconstrained_rows_unchanged_in_a_mixed_batch(llm):
    ps = [{"prompt_token_ids": p} for p in prompts(6, seed=5)]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(ps, plain, use_tqdm=False)
    guided = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mixed = llm.generate(ps, [plain, guided] * 3, use_tqdm=False)
    for i in range(0, 6, 2):
        assert mixed[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
    for i in range(1, 6, 2):
        assert mixed[i].outputs[0].token_ids != alone[i].outputs[0].token_ids


def test_preemption_chunked_prefill_n_and_stop(tmp_path):
    # A KV pool far too small for 12 long requests forces recompute preemption mid-output.
    path = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    llm = LLM(str(path), num_threads=1, num_gpu_blocks=40, block_size=8, max_model_len=300,
              max_num_batched_tokens=32)
    spec = StructuredOutputsParams(json=SCHEMA)
    ps = [{"prompt_token_ids": p} for p in prompts(6, seed=7, min_len=100, max_len=150)]
    outs = llm.generate(ps, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=120, structured_outputs=spec),
                        use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    for out in outs:
        assert len(out.outputs) == 2
        for c in out.outputs:
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len(llm.llm_engine.guided) == 0  # matchers are dropped with their requests
    # A stop string ends a constrained output early.
    out = llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=40, stop=["-"],
                                              structured_outputs=StructuredOutputsParams(regex="abc-[0-9]+")),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "abc" and out.stop_reason == "-"


def test_bad_specs_are_clear_errors_and_the_engine_keeps_serving(llm):
    for spec, words in ((dict(json={"type": "objectx"}), "objectx"), (dict(regex="a(b"), "regex"),
                        (dict(grammar="start: undefined_rule"), "undefined_rule")):
        with pytest.raises(ValueError, match=words):
            llm.generate([[5, 6, 7]], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)),
                         use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=["ok"])), use_tqdm=False)[0]
    assert out.outputs[0].text == "ok"


def test_grammar_compiled_once_per_spec(llm):
    compiler = llm.llm_engine.guided.compiler
    a = compiler.submit(StructuredOutputsParams(json=SCHEMA))
    assert compiler.submit(StructuredOutputsParams(json=json.dumps(SCHEMA))) is a
    assert compiler.submit(StructuredOutputsParams(regex=REGEX)) is not a


def test_structured_outputs_params_are_plain_data():
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    from dataclasses import asdict
    assert json.loads(json.dumps(asdict(params)))["structured_outputs"]["choice"] == ["a", "b"]


def test_logit_bias(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={"77": 100.0})
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids == [77] * 5
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="logit_bias token ids"):
        llm.generate([[5, 6, 7]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_skip_tokenizer_init(llm):
    path = llm.llm_engine.loaded.path
    bare = LLM(str(path), num_threads=1, max_model_len=512, skip_tokenizer_init=True)
    assert bare.llm_engine.tokenizer is None
    params = SamplingParams(temperature=0, max_tokens=8)
    ps = [{"prompt_token_ids": p} for p in prompts(3, seed=9)]
    ref = llm.generate(ps, params, use_tqdm=False)
    got = bare.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert all(o.outputs[0].text == "" for o in got)
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate("hello", params, use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate(ps[:1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")), use_tqdm=False)
