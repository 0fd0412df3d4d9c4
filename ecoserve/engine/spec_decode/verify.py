"""Lossless verification of one request's proposals against the target's logits (standard rejection sampling).

Position i's target distribution is the sampler's own: raw logits, then min_tokens, logit_bias, penalties (over
the output with the proposals before i appended), a grammar mask, temperature, top-k, top-p and min-p. Proposal
d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); the first rejected position draws from the residual
max(p_i - q_i, 0) normalised, and when all are kept one more token comes from the next position. q is the
draft's distribution, or one-hot for a deterministic proposer (n-gram). Greedy rows keep a proposal exactly
when it is the target's argmax, so greedy output equals non-speculative greedy output token for token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ecoserve.engine.sampler import (Sampler, SamplingRow, apply_logit_bias, apply_min_tokens, apply_penalties,
                                     apply_truncation, argmax_rows, draw_seed)
from ecoserve.request import Logprobs, Request


@dataclass
class Verified:
    """What one request emits in the step: accepted proposals then the target's own token."""

    token_ids: list[int]
    num_accepted: int
    logprobs: list[Logprobs] | None = None
    sampled_logprobs: list[float] | None = None


def position_rows(request: Request, proposals: list[int], generator: torch.Generator | None) -> list[SamplingRow]:
    """One sampling row per verified position: position i sees the output with proposals [:i] appended."""
    out = list(request.output_token_ids)
    rows = []
    for i in range(len(proposals) + 1):
        rows.append(SamplingRow(request.sampling_params, request.prompt_token_ids, out + proposals[:i],
                                request.eos_token_ids, generator))
    return rows


_FINAL_SALT = 0x0F1A_7E57  # a seeded request's last draw of a step comes from its own stream


def _uniforms(rows: list[SamplingRow], device: torch.device, salt: int = 0) -> list[float]:
    """One U(0, 1) draw per row. A seeded row's draw comes from (seed, salt, its position) alone: each position's
    acceptance test and its final draw use different streams, and a position decided in one step is never
    verified again, so no draw decides two tokens."""
    if not rows:
        return []
    gen = rows[0].generator
    if gen is None:
        return torch.rand(len(rows), device=device).tolist()
    out = []
    for row in rows:
        gen.manual_seed(draw_seed((row.params.seed or 0) ^ salt, row.position))
        out.append(float(torch.rand(1, generator=gen, device=device)))
    return out


def _draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from an (unnormalised) probability row."""
    cdf = probs.double().cumsum(0)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)))
    return min(idx, probs.shape[0] - 1)


def target_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The sampler's processed logits per position (before temperature): what greedy takes the argmax of."""
    processed = logits.float().clone()
    apply_min_tokens(processed, rows)
    apply_logit_bias(processed, rows)
    apply_penalties(processed, rows)
    return processed


def target_probs(processed: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution the sampler draws from at each position (temperature, then top-k, top-p, min-p)."""
    params = [r.params for r in rows]
    temp = torch.tensor([p.temperature for p in params], device=processed.device).unsqueeze(1)
    return torch.softmax(apply_truncation(processed / temp, params), dim=-1)


def verify(logits: torch.Tensor, proposals: list[int], draft_probs: torch.Tensor | None,
           rows: list[SamplingRow], masks: torch.Tensor | None = None) -> Verified:
    """Accept a prefix of `proposals` and add one token of the target's.

    logits: [k + 1, vocab], the target's raw logits at the request's newest token and at each proposal; rows:
    `position_rows`; draft_probs: [k, vocab] the draft's q per proposal (None: one-hot proposals); masks:
    [k + 1, vocab] bool, True where a grammar allows a token (None: no grammar).
    """
    k = len(proposals)
    if masks is not None:  # as the sampler sees them: forbidden tokens are -inf in the raw logits already
        logits = logits.masked_fill(~masks, float("-inf"))
    processed = target_logits(logits, rows)
    params = rows[0].params
    if params.greedy:
        best = argmax_rows(processed).tolist()
        accepted = 0
        while accepted < k and proposals[accepted] == best[accepted]:
            accepted += 1
        tokens = proposals[:accepted] + [best[accepted]]
    else:
        probs = target_probs(processed, rows)
        u = _uniforms(rows[:k], logits.device)
        accepted, tokens = 0, []
        while accepted < k:
            d = proposals[accepted]
            p = float(probs[accepted, d])
            q = 1.0 if draft_probs is None else float(draft_probs[accepted, d])
            if q > 0 and u[accepted] * q < p:  # u < p / q without the division
                tokens.append(d)
                accepted += 1
                continue
            residual = probs[accepted].clone()
            if draft_probs is None:
                residual[d] = 0.0
            else:
                residual = (residual - draft_probs[accepted].to(residual.dtype)).clamp_min_(0.0)
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: the target's own row is the residual
                residual = probs[accepted]
            tokens.append(_draw(residual, _uniforms(rows[accepted:accepted + 1], logits.device, _FINAL_SALT)[0]))
            break
        else:
            tokens.append(_draw(probs[k], _uniforms(rows[k:], logits.device, _FINAL_SALT)[0]))
    verified = Verified(tokens, accepted)
    if params.logprobs is not None:
        n = len(tokens)
        sampled, top = Sampler._logprobs(logits[:n].float(), torch.tensor(tokens, device=logits.device), rows[:n],
                                         list(range(n)))
        verified.logprobs, verified.sampled_logprobs = top, sampled
    return verified
