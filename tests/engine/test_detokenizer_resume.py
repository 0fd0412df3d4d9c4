"""A detokenizer continued elsewhere (a migrated stream, FuDG's decode leg) releases exactly the text the
first one would have released from there on: no gap, no repeat, multi-byte characters and stop strings
that span the split point included."""
import pytest

from ecoserve.engine.detokenizer import IncrementalDetokenizer
from ecoserve.sampling import SamplingParams
from tests.utils import make_tokenizer

PROMPT = "Once upon a time"
TEXT = " héllo wörld ☃ the snow, ünïcödé ✓ done"


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def released(det: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """The text released after each token (as the engine takes it every step), and the stop hit."""
    out = []
    for t in ids:
        stop = det.append(t)
        out.append(det.take_new_text(final=stop is not None))
        if stop is not None:
            return out, stop
    return out, None


def split_run(tokenizer, prompt, ids, params, k):
    first = IncrementalDetokenizer(tokenizer, prompt, params)
    head, stop = released(first, ids[:k])
    assert stop is None
    given = "".join(head)
    rest_params = params.clone(min_tokens=max(params.min_tokens - k, 0))
    second = IncrementalDetokenizer.resumed(tokenizer, prompt, ids[:k], rest_params, len(given))
    tail, stop = released(second, ids[k:])
    return given + "".join(tail), stop


def test_every_split_point_gives_the_same_text(tokenizer):
    prompt, ids = tokenizer.encode(PROMPT), tokenizer.encode(TEXT)
    params = SamplingParams()
    whole, _ = released(IncrementalDetokenizer(tokenizer, prompt, params), ids)
    assert "".join(whole) == TEXT
    multibyte = [k for k in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:k])]
    assert multibyte, "the text should split a multi-byte character somewhere"
    for k in range(1, len(ids)):
        assert split_run(tokenizer, prompt, ids, params, k) == (TEXT, None), k


def test_a_stop_string_across_the_split_point_is_found(tokenizer):
    prompt, ids = tokenizer.encode(PROMPT), tokenizer.encode(TEXT)
    params = SamplingParams(stop=["the snow"])
    whole, stop = released(IncrementalDetokenizer(tokenizer, prompt, params), ids)
    assert stop == "the snow" and "".join(whole) == TEXT[:TEXT.index("the snow")]
    n = len(whole)  # the token that completes the stop string
    for k in range(1, n):
        assert split_run(tokenizer, prompt, ids, params, k) == ("".join(whole), "the snow"), k


def test_min_tokens_counts_from_the_start(tokenizer):
    """A stop string completed before min_tokens stays text, wherever the split falls."""
    prompt, ids = tokenizer.encode(PROMPT), tokenizer.encode(TEXT)
    n_stop = len(released(IncrementalDetokenizer(tokenizer, prompt, SamplingParams(stop=["the snow"])), ids)[0])
    params = SamplingParams(stop=["the snow"], min_tokens=n_stop + 1, max_tokens=200)
    whole, stop = released(IncrementalDetokenizer(tokenizer, prompt, params), ids)
    assert stop is None and "".join(whole) == TEXT
    for k in range(1, len(ids)):
        assert split_run(tokenizer, prompt, ids, params, k) == (TEXT, None), k
