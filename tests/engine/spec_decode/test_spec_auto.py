"""`num_speculative_tokens: "auto"` in the engine: the tuner is the length policy, outputs stay greedy-exact."""
import pytest

from ecoserve.engine.llm import LLM
from ecoserve.engine.spec_decode.tuner import TunedLength
from ecoserve.sampling import SamplingParams
from tests.utils import make_tiny_checkpoint

# a prompt that repeats itself, so prompt lookup finds proposals, and one that does not
PROMPTS = [[5 + i % 7 for i in range(40)], [3 + (i * 37) % 200 for i in range(24)]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("auto") / "m", "llama"))


def generate(llm: LLM, max_tokens: int = 40) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_auto_is_greedy_exact_and_speculates(model_path):
    plain = generate(LLM(model_path, num_threads=1, num_gpu_blocks=64))
    llm = LLM(model_path, num_threads=1, num_gpu_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": "auto"})
    speculator = llm.llm_engine.speculator
    assert isinstance(speculator.length, TunedLength)
    assert speculator.max_tokens == speculator.length.max_tokens
    assert generate(llm) == plain
    assert speculator.counters.num_drafts > 0  # it did propose: the step times were measured and read
    assert len(speculator.step_times.seconds) >= 2
    assert sum(speculator.length.tuner.stats.chosen.values()) > 0
    assert not speculator.length._seen  # finished requests leave no state behind
