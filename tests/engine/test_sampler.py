import math

import pytest
import torch

from ecoserve.engine.sampler import (Sampler, SamplerOutput, SamplingRow, apply_min_tokens, apply_penalties,
                                     draw_seed, make_generator, prompt_logprobs)
from ecoserve.request import Request
from ecoserve.sampling import SamplingParams

# A fixed distribution for the statistical tests; token 7 has probability 0.
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02, 0.0])
LOGITS = PROBS.log()
DRAWS = 20_000
TOL = 0.015  # > 4 standard deviations for any p at 20k draws


def frequencies(params: SamplingParams, logits: torch.Tensor = LOGITS, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    rows = [SamplingRow(params)] * DRAWS
    out = Sampler()(logits.expand(DRAWS, -1).contiguous(), rows)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[0]).float() / DRAWS


def renormalized(keep: list[int], probs: torch.Tensor = PROBS) -> torch.Tensor:
    p = torch.zeros_like(probs)
    p[keep] = probs[keep]
    return p / p.sum()


def check_distribution(freq: torch.Tensor, expected: torch.Tensor) -> None:
    assert (freq[expected == 0] == 0).all(), f"tokens outside the allowed set drawn: {freq}"
    assert (freq - expected).abs().max() < TOL, f"{freq} vs {expected}"


def test_plain_sampling_follows_softmax():
    check_distribution(frequencies(SamplingParams()), PROBS)


def test_temperature():
    expected = PROBS ** 0.5
    check_distribution(frequencies(SamplingParams(temperature=2.0)), expected / expected.sum())


def test_top_k():
    check_distribution(frequencies(SamplingParams(top_k=3)), renormalized([0, 1, 2]))
    check_distribution(frequencies(SamplingParams(top_k=1)), renormalized([0]))


def test_top_p():
    # Mass before token 2 is 0.65 < 0.7, before token 3 it is 0.80: tokens 0..2 stay.
    check_distribution(frequencies(SamplingParams(top_p=0.7)), renormalized([0, 1, 2]))
    check_distribution(frequencies(SamplingParams(top_p=0.3)), renormalized([0]))


def test_top_k_then_top_p_renormalizes():
    # After top-k=2: probabilities 0.615 and 0.385, so top_p=0.6 keeps only token 0... and 0.62 keeps both.
    check_distribution(frequencies(SamplingParams(top_k=2, top_p=0.6)), renormalized([0]))
    check_distribution(frequencies(SamplingParams(top_k=2, top_p=0.62)), renormalized([0, 1]))


def test_min_p():
    # min_p=0.3 keeps p >= 0.12; min_p=0.5 keeps p >= 0.2.
    check_distribution(frequencies(SamplingParams(min_p=0.3)), renormalized([0, 1, 2]))
    check_distribution(frequencies(SamplingParams(min_p=0.5)), renormalized([0, 1]))


def test_mixed_batch_each_row_uses_its_own_params():
    torch.manual_seed(1)
    n = 6000
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.7), SamplingParams(min_p=0.5)]
    rows = [SamplingRow(params[i % 3]) for i in range(n)]
    out = Sampler()(LOGITS.expand(n, -1).contiguous(), rows)
    tokens = torch.tensor(out.token_ids).view(-1, 3)
    assert set(tokens[:, 0].tolist()) == {0}
    assert set(tokens[:, 1].tolist()) == {0, 1, 2}
    assert set(tokens[:, 2].tolist()) == {0, 1}


def test_greedy_equals_argmax():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(-1).tolist()
    rows = [SamplingRow(SamplingParams(temperature=0.0)) for _ in range(16)]
    assert Sampler()(logits, rows).token_ids == expected
    # Greedy rows next to sampled rows, and greedy rows asking for logprobs, still take the argmax.
    rows = [SamplingRow(SamplingParams(temperature=0.0 if i % 2 else 1.0, logprobs=2 if i % 4 == 1 else None))
            for i in range(16)]
    out = Sampler()(logits, rows)
    assert [t for i, t in enumerate(out.token_ids) if i % 2] == expected[1::2]


def test_greedy_fast_path_returns_no_logprobs():
    out = Sampler()(torch.tensor([[0.0, 2.0, 1.0]]), [SamplingRow(SamplingParams(temperature=0.0))])
    assert out == SamplerOutput([1], None, None)


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    vocab, steps = 500, 8
    step_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.5, seed=1234)

    def run(neighbours: int, position: int) -> list[int]:
        gen = make_generator(params.seed)
        other_gen = make_generator(99)
        tokens, others = [], []
        for step in range(steps):
            torch.manual_seed(step * 7 + neighbours)  # global RNG differs between runs
            rows = [SamplingRow(SamplingParams(temperature=1.0)) for _ in range(neighbours)]
            rows.append(SamplingRow(SamplingParams(temperature=0.8, seed=99), [1] * neighbours, others,
                                    generator=other_gen))
            rows.insert(position, SamplingRow(params, [1, 2, 3], tokens, generator=gen))
            logits = torch.randn(len(rows), vocab)
            logits[position] = step_logits[step]
            out = Sampler()(logits, rows).token_ids
            tokens.append(out[position])
            others.append(out[-1])
        return tokens

    alone = run(0, 0)
    assert run(3, 2) == alone
    assert run(7, 5) == alone
    assert len(set(alone)) > 1  # really sampled, not a degenerate distribution


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    draws = [Sampler()(logits, [SamplingRow(SamplingParams(seed=s), generator=make_generator(s))]).token_ids[0]
             for s in range(5)]
    assert len(set(draws)) > 1


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    row = SamplingRow(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.1),
                      prompt_token_ids=[0], output_token_ids=[1, 1, 2])
    apply_penalties(logits, [row])
    # token 0 (prompt): 2/2; token 1 (output x2): -1*2 - 0.5*2 - 0.1; token 2 (output x1): 0.5/2 - 0.5 - 0.1
    expected = torch.tensor([[1.0, -3.1, -0.35, 3.0, -2.0]])
    torch.testing.assert_close(logits, expected)


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    row = SamplingRow(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5), prompt_token_ids=[0, 0],
                      output_token_ids=[2, 2, 2])
    apply_penalties(logits, [row])
    torch.testing.assert_close(logits, torch.tensor([[1.0, 1.0, 1.0 - 3.0 - 0.5]]))


def test_penalties_only_touch_rows_that_ask():
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    rows = [SamplingRow(SamplingParams(), output_token_ids=[1]),
            SamplingRow(SamplingParams(repetition_penalty=4.0), output_token_ids=[1])]
    apply_penalties(logits, rows)
    torch.testing.assert_close(logits, torch.tensor([[1.0, 2.0], [1.0, 0.5]]))


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[1.0, 1.5, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert Sampler()(logits, [SamplingRow(greedy, output_token_ids=[1])]).token_ids == [1]
    penalized = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(logits, [SamplingRow(penalized, prompt_token_ids=[1])]).token_ids == [0]


def test_min_tokens_blocks_eos_and_stop_ids():
    eos, stop_id = 3, 4
    logits = torch.tensor([[0.0, 0.1, 0.2, 10.0, 9.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop_id])
    row = SamplingRow(params, output_token_ids=[1], eos_token_ids=frozenset({eos}))
    assert Sampler()(logits, [row]).token_ids == [2]
    done = SamplingRow(params, output_token_ids=[1, 1], eos_token_ids=frozenset({eos}))
    assert Sampler()(logits, [done]).token_ids == [eos]

    torch.manual_seed(0)
    sampled = SamplingParams(min_tokens=5, stop_token_ids=[stop_id])
    rows = [SamplingRow(sampled, output_token_ids=[0] * (i % 5), eos_token_ids=frozenset({eos}))
            for i in range(2000)]
    tokens = Sampler()(logits.expand(2000, -1).contiguous(), rows).token_ids
    assert not {eos, stop_id} & set(tokens)


def test_min_tokens_with_ignore_eos_leaves_eos_alone():
    logits = torch.tensor([[0.0, 10.0, 9.0]])
    row = SamplingRow(SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[1]),
                      eos_token_ids=frozenset({2}))
    apply_min_tokens(logits, [row])
    assert logits[0, 1] == -math.inf and logits[0, 2] == 9.0


def test_logprobs_are_raw_and_contain_the_sampled_token():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    raw_lp = torch.log_softmax(logits, dim=-1)
    rows = [SamplingRow(SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=5),
                        output_token_ids=[0, 1]),
            SamplingRow(SamplingParams(logprobs=None)),
            SamplingRow(SamplingParams(temperature=0.0, logprobs=0)),
            SamplingRow(SamplingParams(min_p=0.9, logprobs=1))]
    before = logits.clone()
    out = Sampler()(logits, rows)
    torch.testing.assert_close(logits, before)  # the caller's logits are not modified
    assert out.sampled_logprobs[1] is None and out.top_logprobs[1] is None
    for i, k in [(0, 5), (2, 0), (3, 1)]:
        tok = out.token_ids[i]
        top = out.top_logprobs[i]
        assert out.sampled_logprobs[i] == pytest.approx(raw_lp[i, tok].item(), abs=1e-6)
        assert top[tok] == pytest.approx(raw_lp[i, tok].item(), abs=1e-6)
        expected_top = raw_lp[i].topk(k).indices.tolist()
        assert set(top) == set(expected_top) | {tok}
        for t, v in top.items():
            assert v == pytest.approx(raw_lp[i, t].item(), abs=1e-6)
    assert out.top_logprobs[2] == {out.token_ids[2]: pytest.approx(raw_lp[2].max().item(), abs=1e-6)}


def test_half_precision_logits_are_accepted():
    logits = torch.tensor([[0.0, 3.0, 1.0]], dtype=torch.bfloat16)
    out = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0.0, logprobs=1))])
    assert out.token_ids == [1] and isinstance(out.sampled_logprobs[0], float)


def test_rows_must_match_logits():
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 5), [SamplingRow(SamplingParams())])
    assert Sampler()(torch.zeros(0, 5), []).token_ids == []


def test_row_from_request():
    req = Request("r", [1, 2], SamplingParams(min_tokens=2), arrival_time=0.0, eos_token_ids=frozenset({0}))
    req.append_output_token(5)
    row = SamplingRow.from_request(req)
    assert row.prompt_token_ids == [1, 2] and row.output_token_ids == [5] and row.eos_token_ids == {0}
    assert row.blocks_stops
    req.append_output_token(6)
    assert not row.blocks_stops  # the row reads the request's live lists


def test_prompt_logprobs():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    lp = torch.log_softmax(logits, dim=-1)
    nxt = [3, 7, 7, 29]
    out = prompt_logprobs(logits, nxt, 2)
    assert len(out) == 4
    for t, entry in enumerate(out):
        assert entry[nxt[t]] == pytest.approx(lp[t, nxt[t]].item(), abs=1e-6)
        assert set(entry) == set(lp[t].topk(2).indices.tolist()) | {nxt[t]}
    assert [list(e) for e in prompt_logprobs(logits, torch.tensor(nxt), 0)] == [[t] for t in nxt]
    with pytest.raises(ValueError):
        prompt_logprobs(logits, nxt[:3], 1)


def test_a_seeded_draw_depends_on_seed_and_position_only():
    """The same (seed, position) draws the same token whatever the generator's history; others differ."""
    logits = torch.zeros(1, 1000)

    def draw(seed: int, prompt_len: int, num_out: int, gen: torch.Generator) -> int:
        row = SamplingRow(SamplingParams(seed=seed), [0] * prompt_len, [0] * num_out, generator=gen)
        return Sampler()(logits, [row]).token_ids[0]

    used = make_generator(5)
    for _ in range(3):
        draw(5, 3, 0, used)
    assert draw(5, 3, 4, used) == draw(5, 3, 4, make_generator(5)) == draw(5, 7, 0, make_generator(5))
    assert len({draw(5, 3, k, make_generator(5)) for k in range(8)}) > 4
    assert len({draw_seed(s, k) for s in range(50) for k in range(50)}) == 2500
    assert all(0 <= draw_seed(s, 0) < 2 ** 64 for s in (-(2 ** 63), -1, 0, 2 ** 63 - 1))


@pytest.fixture(scope="module")
def engine():
    from ecoserve.config import EngineArgs
    from ecoserve.engine.llm_engine import LLMEngine
    from tests.utils import make_tiny_checkpoint

    import tempfile
    path = make_tiny_checkpoint(tempfile.mkdtemp(prefix="sampler_engine_") + "/m", "llama")
    return LLMEngine(EngineArgs(str(path), num_threads=1, max_model_len=256,
                                num_gpu_blocks=64).create_engine_config())


def _steps(engine, request_id: str) -> list:
    """Each step's delta output of one request, until the engine is idle."""
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


PROMPT_IDS = [11, 23, 35, 47, 59, 61, 73]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=4321, max_tokens=24, ignore_eos=True),
                                    SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=24,
                                                   ignore_eos=True, logprobs=2),
                                    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)],
                         ids=["seeded", "seeded-top-p-logprobs", "greedy"])
def test_a_continued_request_equals_the_uninterrupted_one(engine, params):
    """Run k tokens, then go on as a new request of prompt + those k tokens (what a migration sends):
    the tokens, text and logprobs that follow are the uninterrupted request's."""
    engine.add_request("whole", PROMPT_IDS, params)
    whole = _steps(engine, "whole")
    ids = whole[-1].outputs[0].token_ids
    text = whole[-1].outputs[0].text
    assert len(ids) == 24 and (params.greedy or len(set(ids)) > 6)
    for k in (1, 9, 23):
        head = [o.outputs[0] for o in whole[:k]]
        assert sum(len(c.new_token_ids) for c in head) == k
        given = "".join(c.new_text for c in head)
        rest = params.clone(max_tokens=24 - k)
        engine.add_request("rest", PROMPT_IDS + ids[:k], rest)
        engine.resume_output("rest", k, len(given))
        tail = _steps(engine, "rest")[-1].outputs[0]
        assert ids[:k] + tail.token_ids == ids, k
        assert given + tail.text == text, k
        if params.logprobs is not None:  # the target's, computed from a prefill: equal up to rounding
            for got, want in zip(tail.logprobs, whole[-1].outputs[0].logprobs[k:], strict=True):
                assert got.keys() == want.keys()
                assert all(got[t] == pytest.approx(want[t], abs=1e-4) for t in got)


def test_seeded_samples_of_one_request_are_distinct_and_reproducible(engine):
    params = SamplingParams(temperature=1.0, seed=99, n=3, max_tokens=12, ignore_eos=True)
    runs = []
    for rid in ("n1", "n2"):
        engine.add_request(rid, PROMPT_IDS, params)
        runs.append([c.token_ids for c in _steps(engine, rid)[-1].outputs])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 3
    # sample i draws what a single request seeded with seed + i draws
    engine.add_request("one", PROMPT_IDS, params.clone(n=1, seed=100))
    assert _steps(engine, "one")[-1].outputs[0].token_ids == runs[0][1]
