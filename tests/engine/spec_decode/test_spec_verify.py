"""Rejection sampling keeps the target's distribution exactly; greedy keeps exactly the argmax prefix."""
import pytest
import torch

from ecoserve.engine.spec_decode import verify
from ecoserve.request import Request
from ecoserve.sampling import SamplingParams

VOCAB = 8


def request(params: SamplingParams, output=()) -> Request:
    req = Request("r", [1, 2, 3], params, 0.0)
    for t in output:
        req.append_output_token(t)
    return req


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's test of `counts` against `probs` (cells with probability 0 must be empty)."""
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(1 - torch.special.gammainc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def first_token_counts(params, logits, draft_q, trials, rule=verify.verify):
    """How often each token comes out first when proposals are drawn from `draft_q` (None: a fixed proposal)."""
    torch.manual_seed(0)
    req = request(params)
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    k = logits.shape[0] - 1
    for _ in range(trials):
        if draft_q is None:
            proposals, q = [3, 5][:k], None
        else:
            proposals = [int(torch.multinomial(draft_q[i], 1)) for i in range(k)]
            q = draft_q
        rows = verify.position_rows(req, proposals, None)
        counts[rule(logits, proposals, q, rows).token_ids[0]] += 1
    return counts


@pytest.fixture
def logits():
    torch.manual_seed(1)
    return torch.randn(3, VOCAB) * 1.5


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05)])
@pytest.mark.parametrize("with_draft", [True, False])
def test_first_token_follows_the_target_distribution(params, with_draft, logits):
    draft_q = torch.softmax(torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2)), dim=-1) \
        if with_draft else None
    rows = verify.position_rows(request(params), [0, 0], None)
    target = verify.target_probs(verify.target_logits(logits, rows), rows)[0].double()
    counts = first_token_counts(params, logits, draft_q, 6000)
    assert chi_square_p(counts, target) > 1e-3


def test_a_wrong_acceptance_rule_fails_the_same_check(logits):
    """The test has the power to see a broken rule: accepting every proposal skews the first token towards q."""
    params = SamplingParams(temperature=1.0)
    draft_q = torch.softmax(torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2)), dim=-1)

    def accept_all(logits, proposals, q, rows, masks=None):
        return verify.Verified(list(proposals) + [0], len(proposals))

    rows = verify.position_rows(request(params), [0, 0], None)
    target = verify.target_probs(verify.target_logits(logits, rows), rows)[0].double()
    counts = first_token_counts(params, logits, draft_q, 6000, rule=accept_all)
    assert chi_square_p(counts, target) < 1e-6


def test_second_token_after_an_accepted_first_follows_the_target(logits):
    """Conditioned on the first proposal kept, the next token follows p at position 1 (penalties see the
    kept proposal)."""
    params = SamplingParams(temperature=1.0, presence_penalty=1.5)
    req = request(params)
    torch.manual_seed(0)
    any_rows = verify.position_rows(req, [0, 0], None)  # position 0 does not depend on the proposals
    first = verify.target_probs(verify.target_logits(logits, any_rows), any_rows)[0]
    proposals = [int(first.argmax()), 5]  # the likeliest first token: kept often enough to test what follows
    rows = verify.position_rows(req, proposals, None)
    target = verify.target_probs(verify.target_logits(logits, rows), rows)[1].double()
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(6000):
        out = verify.verify(logits, proposals, None, rows)
        if out.num_accepted >= 1:
            counts[out.token_ids[1]] += 1
    assert counts.sum() > 500
    assert chi_square_p(counts, target) > 1e-3


def test_greedy_keeps_exactly_the_argmax_prefix():
    logits = torch.full((4, VOCAB), -1.0)
    logits[0, 3] = logits[1, 5] = logits[2, 6] = logits[3, 1] = 2.0
    rows = verify.position_rows(request(SamplingParams(temperature=0)), [3, 5, 7], None)
    out = verify.verify(logits, [3, 5, 7], None, rows)
    assert out.token_ids == [3, 5, 6] and out.num_accepted == 2
    rows = verify.position_rows(request(SamplingParams(temperature=0)), [3, 5, 6], None)
    assert verify.verify(logits, [3, 5, 6], None, rows).token_ids == [3, 5, 6, 1]


def test_grammar_masks_forbid_at_every_position():
    logits = torch.zeros(3, VOCAB)
    logits[:, 4] = 5.0  # the target's favourite, forbidden at position 1
    masks = torch.ones(3, VOCAB, dtype=torch.bool)
    masks[1, 4] = False
    for seed in range(50):
        params = SamplingParams(temperature=1.0, seed=seed)
        rows = verify.position_rows(request(params), [4, 4], torch.Generator())
        out = verify.verify(logits, [4, 4], None, rows, masks)
        assert len(out.token_ids) < 2 or out.token_ids[1] != 4
