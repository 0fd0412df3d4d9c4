"""Draft-model proposals: a second, smaller (or quantized: the self-draft) model of the same vocabulary guesses
k tokens autoregressively, in this process, over its own paged KV cache.

Each step the draft catches up with the tokens the target accepted since its last proposal (one chunk per
request: the proposals it had fed that the target rejected are overwritten), then decodes k - 1 more tokens.
It draws each proposal from its own distribution q (the request's temperature; greedy requests take its argmax)
and hands q to verification, which keeps the target's distribution exact whatever q is.
"""
from __future__ import annotations

import logging

import torch

from ecoserve.engine.attention import PagedAttention
from ecoserve.engine.kv_cache import PagedKVCache, resolve_cache_dtype
from ecoserve.engine.sampler import draw_seed
from ecoserve.kv.block_pool import BlockPool, KVBlock
from ecoserve.request import Request

logger = logging.getLogger(__name__)
_DRAFT_SALT = 0x5D5D_0D0D  # a seeded request's draft draws differ from its verification draws


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: str = "cpu",
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        """The draft's own KV cache: `num_blocks` blocks, handed out here (not by the scheduler)."""
        self.model = model
        self.device = torch.device(device)
        cache = PagedKVCache(model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim,
                             kv_cache_dtype or model.dtype, self.device)
        self.attention = PagedAttention(cache)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._fed: dict[str, list[int]] = {}  # tokens whose KV the draft cache holds, from position 0
        self._known: dict[str, int] = {}  # how many of them were the request's own tokens when fed

    @classmethod
    def load(cls, config, target, num_blocks: int) -> "DraftModelProposer":
        """Load `config.speculative.model` like the target (dtype, device), with the draft's own quantization;
        refuse a draft whose vocabulary is not the target's."""
        from ecoserve.model.loader import load_model

        spec = config.speculative
        draft = load_model(spec.model, dtype=config.dtype, device=config.device, quantization=spec.quantization,
                           cpu_linear=config.cpu_linear, skip_tokenizer_init=target.tokenizer is None)
        check_vocabulary(target, draft)
        max_model_len = config.scheduler.max_model_len or target.max_model_len
        draft.model.ensure_positions(max_model_len)
        cache_dtype = resolve_cache_dtype(config.cache.cache_dtype, draft.model.dtype)
        logger.info("speculative decoding: draft %s (%s), %d KV blocks", spec.model, draft.quantization or "float",
                    num_blocks)
        return cls(draft.model, num_blocks, config.cache.block_size, config.device, cache_dtype)

    # ---- state per request -----------------------------------------------------------------
    def forget(self, request_ids) -> None:
        for rid in request_ids:
            blocks = self._blocks.pop(rid, None)
            if blocks:
                self.pool.free(blocks[::-1])
            self._fed.pop(rid, None)
            self._known.pop(rid, None)

    def _reserve(self, rid: str, num_tokens: int) -> list[int] | None:
        """The block table covering `num_tokens` positions; None (and the request's draft KV dropped) if the
        draft's cache is full: the request goes without proposals until there is room."""
        blocks = self._blocks.setdefault(rid, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > 0:
            if need > self.pool.num_free_blocks:
                self.forget([rid])
                return None
            blocks.extend(self.pool.allocate(need))
        return [b.block_id for b in blocks]

    def _valid_prefix(self, rid: str, tokens: list[int]) -> int:
        """Positions whose draft KV was computed from the request's actual tokens."""
        fed = self._fed.get(rid)
        if not fed:
            return 0
        valid = self._known[rid]  # these were the request's own tokens when fed; its later ones were guesses
        limit = min(len(fed), len(tokens))
        while valid < limit and fed[valid] == tokens[valid]:
            valid += 1
        return valid

    # ---- proposing --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_batch(self, wants: list[tuple[Request, int]]) -> list[tuple[list[int], torch.Tensor | None]]:
        """For each (request, k): k proposals and their q ([k, vocab]; None for a greedy request's argmax)."""
        live, out = [], [([], None)] * len(wants)
        for i, (req, k) in enumerate(wants):
            rid, tokens = req.request_id, req.all_token_ids
            valid = min(self._valid_prefix(rid, tokens), len(tokens) - 1)  # at least one token to feed
            table = self._reserve(rid, len(tokens) + k - 1)
            if table is None:
                continue
            fed = self._fed.setdefault(rid, [])
            del fed[valid:]
            fed.extend(tokens[valid:])
            self._known[rid] = len(tokens)
            live.append((i, req, k, table, valid))
        if not live:
            return out
        drafts: dict[int, list[int]] = {i: [] for i, *_ in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, *_ in live}
        # round 0 catches up with the accepted tokens; round j > 0 feeds proposal j - 1
        for j in range(max(k for _, _, k, _, _ in live)):
            ids, spans, members = [], [], []
            for i, req, k, table, valid in live:
                if j >= k:
                    continue
                if j == 0:
                    feed = req.all_token_ids[valid:]
                    start = valid
                else:
                    feed = [drafts[i][-1]]
                    start = len(req.all_token_ids) + j - 1
                    self._fed[req.request_id].append(feed[0])
                ids.extend(feed)
                spans.append((start, len(feed), table, len(feed) != 1))
                members.append((i, req))
            logits = self._forward(ids, spans)
            for row, (i, req) in enumerate(members):
                token, q = self._draw(logits[row], req, len(req.all_token_ids) + j)
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
        for i, *_ in live:
            out[i] = (drafts[i], torch.stack(probs[i]) if probs[i] else None)
        return out

    def _forward(self, ids: list[int], spans) -> torch.Tensor:
        """The draft's logits at the last position of each span."""
        device, attention = self.device, self.attention
        positions = torch.cat([torch.arange(s, s + n) for s, n, _, _ in spans]).to(device)
        attention.meta = attention.build_metadata(spans)
        try:
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=device), positions, attention)
        finally:
            attention.meta = None
        last, at = [], 0
        for _, n, _, _ in spans:
            at += n
            last.append(at - 1)
        return self.model.compute_logits(hidden[torch.tensor(last, device=hidden.device)]).float()

    @staticmethod
    def _draw(logits: torch.Tensor, req: Request, position: int) -> tuple[int, torch.Tensor | None]:
        params = req.sampling_params
        if params.greedy:
            return int(logits.argmax()), None
        q = torch.softmax(logits / params.temperature, dim=-1)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=q.device)
            gen.manual_seed(draw_seed(params.seed ^ _DRAFT_SALT, position))
        return int(torch.multinomial(q, 1, generator=gen)), q


def check_vocabulary(target, draft) -> None:
    """The draft must score the target's token ids: same vocabulary size and, with tokenizers, the same token at
    every id the models score (a converted tokenizer may add tokens past them, e.g. one read from a GGUF)."""
    size = target.spec.vocab_size
    if draft.spec.vocab_size != size:
        raise ValueError(f"the draft model's vocabulary has {draft.spec.vocab_size} tokens, the target's "
                         f"{size}: speculative decoding needs the target's tokenizer")

    def scored(tokenizer) -> dict[str, int]:
        return {token: i for token, i in tokenizer.get_vocab().items() if i < size}

    if target.tokenizer is not None and draft.tokenizer is not None and \
            scored(target.tokenizer) != scored(draft.tokenizer):
        raise ValueError("the draft model's tokenizer maps tokens to other ids than the target's: speculative "
                         "decoding needs the target's tokenizer")
