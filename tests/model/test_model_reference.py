"""The shared HF reference helpers in tests/utils.py behave as documented."""
from __future__ import annotations

import pytest
import torch

from ecoserve.model.loader import load_model
from tests.utils import dense_greedy, hf_greedy, hf_logits, hf_logprobs, make_tiny_checkpoint, make_tokenizer, prompts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ref"), "llama")


def eos_prompt(path) -> list[int]:
    # seed 3 of the default tiny llama reaches EOS within 16 tokens
    return next(p for p in prompts(4, seed=3, min_len=5, max_len=60) if 2 in hf_greedy(path, p, 16))


def test_hf_greedy_stops_at_eos_unless_ignored(ckpt):
    ids = eos_prompt(ckpt)
    stopped = hf_greedy(ckpt, ids, 16)
    assert stopped[-1] == 2 and len(stopped) < 16
    full = hf_greedy(ckpt, ids, 16, ignore_eos=True)
    assert len(full) == 16 and full[:len(stopped)] == stopped
    assert dense_greedy(load_model(str(ckpt)).model, ids, 16) == full


def test_hf_logprobs_agree_with_logits(ckpt):
    ids = prompts(1, seed=1)[0]
    tokens, steps = hf_logprobs(ckpt, ids, 8, num_logprobs=3, ignore_eos=True)
    assert tokens == hf_greedy(ckpt, ids, 8, ignore_eos=True)
    logprobs = torch.log_softmax(hf_logits(ckpt, ids + tokens), dim=-1)
    for i, (token, step) in enumerate(zip(tokens, steps)):
        assert token in step and 3 <= len(step) <= 4
        for tok, lp in step.items():
            assert lp == pytest.approx(logprobs[len(ids) - 1 + i, tok].item(), abs=1e-4)


def test_tokenizer_is_fresh_and_has_chat_template():
    a, b = make_tokenizer(), make_tokenizer()
    assert a is not b and len(a) == 512
    assert (a.pad_token_id, a.bos_token_id, a.eos_token_id) == (0, 1, 2)
    text = a.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>\nHi</s>\n<|assistant|>\n"
