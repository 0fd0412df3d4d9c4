"""Benchmark datasets: random lengths, ShareGPT parsing, synthetic Alpaca/LongBench length means."""
import argparse
import json

import numpy as np
import pytest

from ecoserve.bench.datasets import (NO_TOKENIZER_ID_RANGE, SYNTHETIC_MEANS, load_tokenizer, lognormal_lens,
                                     sample_requests)


def make_args(**kw) -> argparse.Namespace:
    base = dict(dataset_name="random", dataset_path=None, num_prompts=50, seed=0, random_input_len=40,
                random_output_len=10, random_range_ratio=0.5, random_prefix_len=0, sharegpt_output_len=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_random_lengths_with_a_tokenizer(word_tokenizer_dir):
    tok = load_tokenizer(word_tokenizer_dir)
    reqs = sample_requests(make_args(random_prefix_len=5), tok, as_text=False)
    assert len(reqs) == 50
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert 5 + 20 <= r.prompt_len <= 5 + 60  # prefix + [40*(1-0.5), 40*(1+0.5)]
        assert 5 <= r.expected_output_len <= 15
    prefixes = {" ".join(r.prompt.split()[:5]) for r in reqs}
    assert len(prefixes) == 1  # one shared prefix
    assert len({r.prompt_len for r in reqs}) > 5  # lengths actually vary


def test_random_exact_lengths_and_seed(word_tokenizer_dir):
    tok = load_tokenizer(word_tokenizer_dir)
    a = sample_requests(make_args(random_range_ratio=0.0), tok, as_text=False)
    assert {r.prompt_len for r in a} == {40} and {r.expected_output_len for r in a} == {10}
    assert a == sample_requests(make_args(random_range_ratio=0.0), tok, as_text=False)
    assert a != sample_requests(make_args(random_range_ratio=0.0, seed=1), tok, as_text=False)


def test_random_without_a_tokenizer():
    ids = sample_requests(make_args(), None, as_text=False)
    for r in ids:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert 20 <= r.prompt_len <= 60
        assert all(NO_TOKENIZER_ID_RANGE[0] <= i < NO_TOKENIZER_ID_RANGE[1] for i in r.prompt)
    texts = sample_requests(make_args(), None, as_text=True)  # chat endpoints need text
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == r.prompt_len for r in texts)


def test_bad_arguments_say_what_is_right():
    with pytest.raises(ValueError, match=r"range-ratio must be in \[0, 1\)"):
        sample_requests(make_args(random_range_ratio=1.0), None, as_text=False)
    with pytest.raises(ValueError, match="--num-prompts"):
        sample_requests(make_args(num_prompts=0), None, as_text=False)
    with pytest.raises(ValueError, match="--dataset-path"):
        sample_requests(make_args(dataset_name="sharegpt"), None, as_text=False)


@pytest.fixture
def sharegpt_file(tmp_path):
    words = lambda n: " ".join(f"w{i % 200}" for i in range(n))  # noqa: E731
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": words(12)}, {"from": "gpt", "value": words(30)}]},
        {"id": "b", "conversations": [{"from": "human", "value": words(8)}, {"from": "gpt", "value": words(6)},
                                      {"from": "human", "value": "ignored later turn"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": words(20)}]},
        {"id": "d", "conversations": [{"from": "human", "value": words(10)}]},  # no reply: skipped
        {"id": "e", "conversation": [{"role": "user", "content": words(9)},
                                     {"role": "assistant", "content": words(11)}]},
        {"id": "f", "conversations": [{"from": "human", "value": words(1500)}, {"from": "gpt", "value": words(5)}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_sharegpt_parsing(sharegpt_file, word_tokenizer_dir):
    tok = load_tokenizer(word_tokenizer_dir)
    reqs = sample_requests(make_args(dataset_name="sharegpt", dataset_path=sharegpt_file, num_prompts=3), tok, False)
    # "c" (2-token prompt) and "f" (prompt over 1024) are filtered out; "d" has no reply
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(8, 6), (9, 11), (12, 30)]
    fixed = sample_requests(make_args(dataset_name="sharegpt", dataset_path=sharegpt_file, num_prompts=5,
                                      sharegpt_output_len=7), tok, False)
    assert {r.expected_output_len for r in fixed} == {7}
    with pytest.raises(ValueError, match="only 3 usable"):
        sample_requests(make_args(dataset_name="sharegpt", dataset_path=sharegpt_file, num_prompts=4), tok, False)
    no_tok = sample_requests(make_args(dataset_name="sharegpt", dataset_path=sharegpt_file, num_prompts=3), None, True)
    assert all(isinstance(r.prompt, str) and r.prompt_len > 0 for r in no_tok)  # chars/4 estimates


@pytest.mark.parametrize("name", ["alpaca", "longbench"])
def test_synthetic_means_match_the_published_ones(name):
    mean_in, mean_out = SYNTHETIC_MEANS[name]
    rng = np.random.default_rng(0)
    assert lognormal_lens(rng, mean_in, 20000).mean() == pytest.approx(mean_in, rel=0.03)
    assert lognormal_lens(rng, mean_out, 20000).mean() == pytest.approx(mean_out, rel=0.03)
    reqs = sample_requests(make_args(dataset_name=name, num_prompts=300), None, as_text=False)
    assert np.mean([r.prompt_len for r in reqs]) == pytest.approx(mean_in, rel=0.1)
    assert np.mean([r.expected_output_len for r in reqs]) == pytest.approx(mean_out, rel=0.1)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
