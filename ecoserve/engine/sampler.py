"""Sampler: turns one logits row per running request into the next token (plus logprobs).

Order of processing, per row: raw logprobs are taken first (vLLM's default, before anything
changes the logits), then min_tokens masking, logit_bias, penalties, temperature, top-k, top-p, min-p,
and finally greedy argmax or an exponential race (argmax of probs / Exp(1) noise), which lets
seeded rows draw their noise from their own generator.

A seeded row's noise is a function of (seed, position) only: its generator is re-seeded from both
before each draw, where the position is that of the token being sampled in the whole sequence
(prompt + output). A request continued elsewhere as prompt + output so far (a migrated stream,
FuDG's decode leg) therefore draws exactly what it would have drawn where it started.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ecoserve.request import Request
from ecoserve.sampling import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """What the sampler needs to know about the request behind one logits row."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    eos_token_ids: frozenset[int] = frozenset()
    # Seeded requests own a generator that the caller keeps across steps; None: global RNG.
    generator: torch.Generator | None = None

    @property
    def position(self) -> int:
        """Where the token being sampled sits in the sequence: what a seeded draw is keyed by."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @classmethod
    def from_request(cls, request: Request, generator: torch.Generator | None = None) -> "SamplingRow":
        return cls(request.sampling_params, request.prompt_token_ids, request.output_token_ids,
                   request.eos_token_ids, generator)

    @property
    def blocks_stops(self) -> bool:
        """True while min_tokens still forbids EOS and stop token ids."""
        return len(self.output_token_ids) < self.params.min_tokens


@dataclass(frozen=True)
class SamplerOutput:
    """One sampled token per row; logprob lists are None unless some row asked for them.

    Inside the lists, rows that did not ask for logprobs hold None. `top_logprobs[i]` maps
    the row's top-N token ids (by raw logprob) plus its sampled token to their logprobs.
    """

    token_ids: list[int]
    sampled_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float] | None] | None = None


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded row's draw at `position`: distinct per (seed, position), in [0, 2**64)."""
    return _splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request (re-seeded from the seed and position before each draw)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(draw_seed(seed, 0))
    return gen


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value, the first on ties, as `argmax(dim=-1)` gives it: `max(dim=-1)`
    returns the same indices, 2.6x faster on CPU (0.59 against 1.53 ms for [64, 32000] float32, 2 threads)."""
    return x.max(dim=-1).indices


class Sampler:
    """Stateless: everything per-request arrives in the SamplingRows."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        if logits.dtype != torch.float32:
            logits = logits.float()
        if not rows:
            return SamplerOutput([])
        want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want_logprobs and all(r.params.greedy and not r.params.needs_processing and not r.blocks_stops
                                     for r in rows):
            return SamplerOutput(argmax_rows(logits).tolist())

        raw = logits
        logits = logits.clone()
        apply_min_tokens(logits, rows)
        apply_logit_bias(logits, rows)
        apply_penalties(logits, rows)
        tokens = self._sample(logits, rows)

        if not want_logprobs:
            return SamplerOutput(tokens.tolist())
        sampled_lp, top_lp = self._logprobs(raw, tokens, rows, want_logprobs)
        return SamplerOutput(tokens.tolist(), sampled_lp, top_lp)

    # -- sampling ----------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        tokens = argmax_rows(logits)
        idx = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not idx:
            return tokens
        device = logits.device
        sub = logits[idx]
        temp = torch.tensor([rows[i].params.temperature for i in idx], device=device).unsqueeze(1)
        sub = sub / temp
        sub = apply_truncation(sub, [rows[i].params for i in idx])
        probs = torch.softmax(sub, dim=-1)

        # Exp(1) noise as -log(U): several times faster than exponential_() on CPU.
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(idx) if rows[i].generator is None]
        if len(unseeded) == len(idx):
            noise.uniform_()
        else:
            for j, i in enumerate(idx):
                row = rows[i]
                if row.generator is not None:
                    row.generator.manual_seed(draw_seed(row.params.seed or 0, row.position))
                    noise[j].uniform_(generator=row.generator)
            if unseeded:
                noise[unseeded] = torch.rand((len(unseeded), probs.shape[1]), device=device)
        # U = 0 gives infinite noise, so a score of 0: that token just loses this draw.
        noise.log_().neg_()
        tokens[idx] = argmax_rows(probs.div_(noise))
        return tokens

    # -- logprobs ----------------------------------------------------------------------------

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SamplingRow],
                  idx: list[int]) -> tuple[list[float | None], list[dict[int, float] | None]]:
        lp = torch.log_softmax(raw[idx], dim=-1)
        chosen = tokens[idx]
        sampled = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        chosen_ids = chosen.tolist()
        most = min(max(rows[i].params.logprobs for i in idx), lp.shape[1])
        top_vals, top_ids = lp.topk(most, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()

        sampled_out: list[float | None] = [None] * len(rows)
        top_out: list[dict[int, float] | None] = [None] * len(rows)
        for j, i in enumerate(idx):
            k = rows[i].params.logprobs
            entry = dict(zip(top_ids[j][:k], top_vals[j][:k]))
            entry.setdefault(chosen_ids[j], sampled[j])
            sampled_out[i] = sampled[j]
            top_out[i] = entry
        return sampled_out, top_out


# -- logits processors: each edits logits of the rows that need it ----------------------------

def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place. While min_tokens is unmet, forbid stop token ids and EOS (unless ignore_eos:
    then EOS is no stop and may be generated)."""
    row_idx: list[int] = []
    tok_idx: list[int] = []
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        if not r.blocks_stops:
            continue
        stops = set(r.params.stop_token_ids)
        if not r.params.ignore_eos:
            stops.update(r.eos_token_ids)
        for t in stops:
            if t < vocab:
                row_idx.append(i)
                tok_idx.append(t)
    if row_idx:
        logits[torch.tensor(row_idx), torch.tensor(tok_idx)] = _NEG_INF


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: OpenAI's logit_bias, added to the raw logits of the named token ids."""
    row_idx, tok_idx, bias = [], [], []
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        for t, b in (r.params.logit_bias or {}).items():
            if t < vocab:
                row_idx.append(i)
                tok_idx.append(t)
                bias.append(float(b))
    if row_idx:
        logits[torch.tensor(row_idx), torch.tensor(tok_idx)] += torch.tensor(bias, device=logits.device)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place. Repetition (prompt + output tokens: positive logits divided, negative ones
    multiplied), then frequency (x count) and presence (x seen) subtracted for output tokens."""
    idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not idx:
        return
    vocab = logits.shape[1]
    device = logits.device
    sub = logits[idx]
    counts = _token_counts([rows[i].output_token_ids for i in idx], vocab, device)

    rep = torch.tensor([rows[i].params.repetition_penalty for i in idx], device=device).unsqueeze(1)
    if (rep != 1.0).any():
        seen = _token_counts([rows[i].prompt_token_ids if rows[i].params.repetition_penalty != 1.0 else ()
                              for i in idx], vocab, device) > 0
        seen |= counts > 0
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)

    freq = torch.tensor([rows[i].params.frequency_penalty for i in idx], device=device).unsqueeze(1)
    pres = torch.tensor([rows[i].params.presence_penalty for i in idx], device=device).unsqueeze(1)
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits[idx] = sub


def apply_truncation(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """New logits with -inf outside top-k, then top-p (renormalized after top-k), then min-p.

    Works through one cutoff per row, so tokens tied with the last kept one stay too.
    """
    n, vocab = logits.shape
    device = logits.device
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    ps = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    need = [j for j in range(n) if ks[j] or ps[j] < 1.0]
    if need:
        sub = logits[need]
        probs = torch.softmax(sub, dim=-1)
        k = [ks[j] or vocab for j in need]
        top_p = torch.tensor([ps[j] if ps[j] < 1.0 else math.inf for j in need], device=device)
        # A full sort costs ~100x a partial one: widen the partial sort until every top-p row
        # without top-k has reached its mass (top-k rows need only their k).
        open_rows = torch.tensor([not ks[j] for j in need], device=device)
        width = min(vocab, max([kk for kk in k if kk < vocab] + [64]))
        while True:
            vals = probs.topk(width, dim=-1, sorted=True).values
            if width == vocab or not (open_rows & (vals.sum(dim=-1) < top_p)).any():
                break
            width = min(vocab, width * 4)
        pos = torch.arange(width, device=device).unsqueeze(0)
        in_k = pos < torch.tensor(k, device=device).unsqueeze(1)
        vals = vals.masked_fill(~in_k, 0.0)
        mass = torch.where(open_rows, torch.ones_like(top_p), vals.sum(dim=-1))  # renormalizer
        keep = ((vals.cumsum(dim=-1) - vals) < (top_p * mass).unsqueeze(1)) & in_k
        keep[:, 0] = True
        last = keep.sum(dim=-1, keepdim=True) - 1  # kept positions are a prefix of the sorted order
        sub = sub.masked_fill(probs < vals.gather(1, last), _NEG_INF)
        logits = logits.clone()
        logits[need] = sub

    if any(m > 0.0 for m in min_p):
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p); unaffected by renormalizing.
        log_min_p = torch.tensor([math.log(m) if m > 0.0 else _NEG_INF for m in min_p], device=device)
        cutoff = logits.max(dim=-1).values + log_min_p
        logits = logits.masked_fill(logits < cutoff.unsqueeze(1), _NEG_INF)
    return logits


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float counts of each token id in each list (ids >= vocab ignored)."""
    counts = torch.zeros((len(token_lists), vocab + 1), device=device)
    lengths = [len(t) for t in token_lists]
    if sum(lengths):
        flat = torch.tensor([t for toks in token_lists for t in toks], dtype=torch.long, device=device)
        row = torch.repeat_interleave(torch.arange(len(token_lists), device=device),
                                      torch.tensor(lengths, device=device))
        counts.index_put_((row, flat.clamp_max(vocab)), torch.ones_like(flat, dtype=counts.dtype),
                          accumulate=True)
    return counts[:, :vocab]


def prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor | Sequence[int],
                    k: int) -> list[dict[int, float]]:
    """For each prompt position: logprob of the actual next prompt token plus the top-k.

    `logits[t]` is the model output at position t and `next_token_ids[t]` the prompt token at
    t + 1. vLLM reports None for the first prompt token; that is the caller's to prepend.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.as_tensor(next_token_ids, dtype=torch.long, device=lp.device)
    if ids.shape != (lp.shape[0],):
        raise ValueError(f"next_token_ids must have one id per logits row ({lp.shape[0]}), got {tuple(ids.shape)}")
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    ids_list = ids.tolist()
    top_vals, top_ids = lp.topk(min(k, lp.shape[1]), dim=-1)
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out = []
    for t, tok in enumerate(ids_list):
        entry = dict(zip(top_ids[t], top_vals[t]))
        entry.setdefault(tok, chosen[t])
        out.append(entry)
    return out
