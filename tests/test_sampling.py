import pytest

from ecoserve.sampling import SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", 2.0),
    ("min_p", -0.1),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("max_tokens", 0),
    ("n", 0),
    ("min_tokens", -1),
    ("logprobs", 21),
    ("logprobs", -1),
    ("prompt_logprobs", 21),
    ("seed", 1.5),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop_token_ids", [-1]),
])
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*got"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=5, max_tokens=None)


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="stop must be"):
        SamplingParams(stop=["x"], detokenize=False)
    SamplingParams(stop_token_ids=[3], detokenize=False)


def test_normalization_and_properties():
    p = SamplingParams(stop="###", top_k=-1, temperature=0.0)
    assert p.stop == ["###"] and p.top_k == 0 and p.stop_token_ids == []
    assert p.greedy and not p.needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert not SamplingParams(temperature=0.7).greedy
    q = p.clone(temperature=1.0)
    assert not q.greedy and p.greedy and q.stop == ["###"]
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=2.0)


def test_boundaries_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, logprobs=20, prompt_logprobs=0, max_tokens=1, min_tokens=1)
