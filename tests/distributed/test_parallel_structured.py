"""Structured outputs on a parallel instance: the engine's grammar masks reach the output rank, which samples.

PP=2 keeps 2 batches in flight, so each batch's masks are computed at submit time while another
batch runs; seeded samples must equal the single-process engine's token for token and match.
"""
import re

from ecoserve import LLM, SamplingParams
from ecoserve.structured import StructuredOutputsParams
from tests.utils import make_tiny_checkpoint, prompts

REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ["red", "green", "blue", "light blue"]


def sample(path, **kwargs):
    llm = LLM(str(path), num_threads=1, max_model_len=256, step_timeout_s=60, **kwargs)
    specs = [StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES), None] * 2
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, structured_outputs=s) for i, s in enumerate(specs)]
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts(len(specs), seed=5)], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [o.outputs[0] for o in outs]


def test_pp2_structured_outputs_equal_single_engine(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", num_layers=2)
    want = sample(path)
    got = sample(path, pipeline_parallel_size=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for k in range(0, len(got), 3):
        assert re.fullmatch(REGEX, got[k].text), got[k].text
        assert got[k + 1].text in CHOICES
