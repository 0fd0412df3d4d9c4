import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ecoserve.engine.detokenizer import IncrementalDetokenizer
from ecoserve.sampling import SamplingParams

# Text with ASCII, accents, CJK and emoji (including ZWJ sequences and flags): a small
# byte-level BPE splits many of these characters across several tokens.
ALPHABET = (list("abcdefgh xyz.,!#") + list("éüçñ") + list("你好世界中文日本語")
            + ["😀", "🎉", "👍🏽", "🇫🇷", "👨‍👩‍👧"])
SPECIALS = ["<|endoftext|>", "<|im_end|>"]


def _train_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Hello world, the quick brown fox jumps over the lazy dog. Stop here. ### done",
              "你好世界，我们今天去公园散步。中文文本测试。日本語のテキスト、カタカナ",
              "Emoji 😀😃🎉👍🏽 🇫🇷 family 👨‍👩‍👧 Ünïcödé çàfé naïve résumé"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0])


@pytest.fixture(scope="module")
def tokenizer():
    return _train_bpe()


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


class ShownDetokenizer(IncrementalDetokenizer):
    """A detokenizer with what the engine shows of its sequence: the released pieces, joined."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.shown = ""

    def text_so_far(self, final: bool = False) -> str:
        self.shown += self.take_new_text(final)
        return self.shown


def run(tokenizer, ids, params=SamplingParams(), prompt=()):
    """Feed ids one by one; returns (detokenizer, streamed snapshots, stop string or None)."""
    detok = ShownDetokenizer(tokenizer, list(prompt), params)
    snapshots = []
    stop = None
    for t in ids:
        stop = detok.append(t)
        snapshots.append(detok.text_so_far(final=stop is not None))
        if stop is not None:
            break
    return detok, snapshots, stop


def assert_monotone(snapshots, final):
    prev = ""
    for s in snapshots:
        assert s.startswith(prev), (prev, s)
        prev = s
    assert final.startswith(prev)


def test_tokenizer_really_splits_characters(tokenizer):
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode("👨‍👩‍👧🇫🇷")]
    assert any("\ufffd" in p for p in pieces)


def test_random_texts_decode_like_the_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = tokenizer.encode(random_text(rng, rng.randint(1, 40)))
        prompt = tokenizer.encode(random_text(rng, rng.randint(0, 10)))
        detok, snapshots, _ = run(tokenizer, ids, prompt=prompt)
        final = detok.text_so_far(final=True)
        assert final == tokenizer.decode(ids)
        assert "\ufffd" not in final
        assert_monotone(snapshots, final)


def test_random_token_streams_decode_like_the_full_decode(tokenizer):
    # Arbitrary ids, so arbitrary (also invalid) byte sequences and special tokens.
    rng = random.Random(1)
    vocab = len(tokenizer)
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip)
        for _ in range(200):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            detok, snapshots, _ = run(tokenizer, ids, params)
            final = detok.text_so_far(final=True)
            assert final == tokenizer.decode(ids, skip_special_tokens=skip)
            assert_monotone(snapshots, final)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(ALPHABET + SPECIALS), max_size=30).map("".join), st.booleans())
def test_property_incremental_equals_full_decode(tokenizer, text, skip):
    ids = tokenizer.encode(text)
    detok, snapshots, _ = run(tokenizer, ids, SamplingParams(skip_special_tokens=skip))
    final = detok.text_so_far(final=True)
    assert final == tokenizer.decode(ids, skip_special_tokens=skip)
    assert_monotone(snapshots, final)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 399), max_size=30), st.lists(st.integers(0, 399), max_size=8))
def test_property_any_ids_with_prompt(tokenizer, ids, prompt):
    ids = [t % len(tokenizer) for t in ids]
    prompt = [t % len(tokenizer) for t in prompt]
    detok, snapshots, _ = run(tokenizer, ids, prompt=prompt)
    final = detok.text_so_far(final=True)
    if "\ufffd" not in tokenizer.decode(prompt):  # a prompt cut mid-character may bleed into the output
        assert final == tokenizer.decode(ids, skip_special_tokens=True)
    assert_monotone(snapshots, final)


def test_special_tokens(tokenizer):
    ids = tokenizer.encode("hello<|im_end|> 你好<|endoftext|>")
    assert run(tokenizer, ids)[0].text_so_far(True) == "hello 你好"
    kept = run(tokenizer, ids, SamplingParams(skip_special_tokens=False))[0].text_so_far(True)
    assert kept == "hello<|im_end|> 你好<|endoftext|>"


def test_decoding_cost_per_token_is_bounded(tokenizer):
    calls = []

    class Counting:
        def decode(self, ids, **kw):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kw)

    rng = random.Random(2)
    ids = tokenizer.encode(random_text(rng, 2000))
    detok, _, _ = run(Counting(), ids, prompt=tokenizer.encode("context"))
    assert detok.text_so_far(True) == tokenizer.decode(ids)
    assert len(calls) <= 2 * len(ids) + 2
    assert max(calls) <= 16  # windows stay small: no re-decoding of the whole output


def stop_params(stop, include=False):
    return SamplingParams(stop=stop, include_stop_str_in_output=include, max_tokens=None)


def test_stop_string_spanning_two_tokens(tokenizer):
    text = "Hello world. Stop here. more text"
    ids = tokenizer.encode(text)
    detok, snapshots, stop = run(tokenizer, ids, stop_params(["Stop here"]))
    assert stop == "Stop here" and detok.stop_reason == "Stop here"
    assert detok.text_so_far(final=True) == "Hello world. "
    pieces = [tokenizer.decode([t]) for t in ids]
    assert not any("Stop here" in p for p in pieces)  # the match really crosses tokens
    assert all("Stop" not in s for s in snapshots[:-1])


def test_stop_string_in_the_first_token(tokenizer):
    ids = tokenizer.encode("Hello world")
    first = tokenizer.decode(ids[:1])
    detok, snapshots, stop = run(tokenizer, ids, stop_params([first]))
    assert stop == first and snapshots == [""] and detok.text_so_far(True) == ""
    detok, _, _ = run(tokenizer, ids, stop_params([first], include=True))
    assert detok.text_so_far(True) == first


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("abc ### def")
    detok, _, stop = run(tokenizer, ids, stop_params(["###"], include=True))
    assert stop == "###" and detok.text_so_far(True) == "abc ###"


class PieceTokenizer:
    """Each id decodes to a fixed piece of text: full control over token boundaries."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def test_earliest_stop_string_wins():
    tok = PieceTokenizer(["the ", "quick brown fox", " jumps"])
    detok, _, stop = run(tok, [0, 1, 2], stop_params(["fox", "quick brown fox", "brown"]))
    # All three complete with token 1; "quick brown fox" starts first.
    assert stop == "quick brown fox" and detok.text_so_far(True) == "the "


def test_stop_search_looks_back_over_earlier_text():
    tok = PieceTokenizer(["ab", "c", "d", "e"])
    detok, snapshots, stop = run(tok, [0, 1, 2, 3], stop_params(["bcd"]))
    assert stop == "bcd" and snapshots == ["a", "a", "a"] and detok.text_so_far(True) == "a"


def test_multibyte_stop_string(tokenizer):
    ids = tokenizer.encode("abc👨‍👩‍👧xyz")
    detok, snapshots, stop = run(tokenizer, ids, stop_params(["👩"]))
    assert stop == "👩" and detok.text_so_far(True) == "abc👨\u200d"


def test_no_stop_streams_everything(tokenizer):
    ids = tokenizer.encode("Hello ## world #")
    detok, snapshots, stop = run(tokenizer, ids, stop_params(["###"]))
    assert stop is None
    assert snapshots[-1] == "Hello ## world "  # "#" could still start "###"
    assert detok.text_so_far(final=True) == "Hello ## world #"


def test_streamed_text_never_shows_a_stop_string_or_its_start(tokenizer):
    rng = random.Random(3)
    stops = ["中文", "fox!", "😀🎉", "#,#"]
    for _ in range(300):
        text = random_text(rng, rng.randint(1, 30))
        ids = tokenizer.encode(text)
        detok, snapshots, stop = run(tokenizer, ids, stop_params(stops))
        final = detok.text_so_far(final=True)
        full = tokenizer.decode(ids)
        positions = [(full.find(s), s) for s in stops if s in full]
        if positions:
            pos, s = min(positions)
            assert stop is not None and final == full[:pos]
        else:
            assert stop is None and final == full
        for snap in snapshots[:-1] if stop else snapshots:
            assert not any(s in snap for s in stops)
        # Every snapshot is a prefix of the cut final text: no part of a stop string ever leaked.
        assert_monotone(snapshots, final)


def test_stop_strings_wait_for_min_tokens():
    tok = PieceTokenizer(["a", "#", "#", "b", "#", "#", "c"])
    params = SamplingParams(stop=["##"], min_tokens=4, max_tokens=None)
    detok, snapshots, stop = run(tok, range(7), params)
    # The first "##" completes with the 3rd token, before min_tokens: plain text. The second stops.
    assert stop == "##" and detok.text_so_far(True) == "a##b"
    assert snapshots == ["a", "a", "a#", "a##b", "a##b", "a##b"]


def test_appending_after_stop_is_ignored(tokenizer):
    ids = tokenizer.encode("a ### b")
    detok, _, _ = run(tokenizer, ids, stop_params(["###"]))
    assert detok.finished
    assert detok.append(ids[-1]) is None and detok.text_so_far() == "a "


def test_detokenize_false(tokenizer):
    detok = ShownDetokenizer(tokenizer, [1, 2], SamplingParams(detokenize=False))
    for t in tokenizer.encode("hello world"):
        assert detok.append(t) is None
    assert detok.text_so_far() == "" and detok.text_so_far(final=True) == ""


def test_shared_tokenizer_helper_if_present():
    utils = pytest.importorskip("tests.utils")
    make_tokenizer = getattr(utils, "make_tokenizer", None)
    if make_tokenizer is None:
        pytest.skip("tests.utils has no make_tokenizer yet")
    tok = make_tokenizer()
    rng = random.Random(4)
    for _ in range(50):
        ids = tok.encode(random_text(rng, rng.randint(1, 30)))
        detok, snapshots, _ = run(tok, ids)
        final = detok.text_so_far(final=True)
        assert final == tok.decode(ids, skip_special_tokens=True)
        assert_monotone(snapshots, final)
