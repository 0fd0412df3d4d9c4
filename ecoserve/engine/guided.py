"""Guided decoding with llguidance: grammars compiled off the engine thread, one matcher per sequence.

`GrammarCompiler` turns a StructuredOutputsParams into a pristine matcher on its thread pool and
keeps the compilations in a bounded LRU cache keyed by the spec. The engine never waits for one:
a request whose grammar is still compiling waits outside scheduling (the scheduler's
waiting-for-grammar state) and starts once its future is done, or fails alone at its compile
deadline. `GuidedDecoder` keeps each constrained sequence's own matcher (a copy of the pristine
one, so a cache eviction never forces a recompile mid-request), computes the bitmasks of a batch's
constrained rows when the batch is submitted (`GrammarMasks`: the runner applies them before
sampling; rows without a matcher are untouched and cost nothing) and advances the matcher with the
sampled token. The matcher only ever moves on sampled tokens, so a recompute after preemption
leaves it where it was.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ecoserve.structured import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compact JSON with json.dumps' separators: what models write, and no runaway whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = torch.arange(32, dtype=torch.int32)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (not yet checked: the matcher does that)."""
    import llguidance
    from llguidance import LLMatcher

    kind = spec.kind
    if kind == "json":
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark


DEFAULT_CACHE_SIZE = 256  # distinct grammars kept compiled
DEFAULT_COMPILE_TIMEOUT_S = 30.0  # how long a request waits for its grammar before it fails


def default_compile_workers() -> int:
    """Compile threads: half the cores (as vLLM's grammar pool), at most 4, and at least 2 so that one slow
    grammar does not hold up every other until its deadline."""
    return max(2, min(4, (os.cpu_count() or 2) // 2))


class GrammarCompiler:
    """Spec -> Future of a pristine matcher, compiled on a thread pool; the `max_cached` most recently used
    compilations (done or not) are kept, so a repeated spec is compiled once while it stays in use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached: int = DEFAULT_CACHE_SIZE, max_workers: int | None = None) -> None:
        if max_cached < 1:
            raise ValueError(f"the grammar cache must hold at least 1 grammar, got {max_cached}")
        self._hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers or default_compile_workers(),
                                        thread_name_prefix="grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self.max_cached = max_cached

    def __len__(self) -> int:
        return len(self._cache)

    def tokenizer(self):
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:  # ~0.3 s for a 50k vocabulary: built on first use
                import llguidance.hf
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None)
            return self._ll_tokenizer

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The (maybe already finished) compilation of `spec`; its error is a ValueError naming the problem.

        Never blocks on a compilation: a new spec is queued on the pool (evicting the least recently
        used entry when the cache is full; whoever holds that future keeps it)."""
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            while len(self._cache) >= self.max_cached:
                self._cache.popitem(last=False)
            future = self._cache[key] = self._pool.submit(self._compile, spec)
            return future

    def compile(self, spec: StructuredOutputsParams, timeout_s: float | None = None):
        """The pristine matcher of `spec`, waiting for it (for tools and tests; the engine never calls this)."""
        return self.submit(spec).result(timeout_s)

    def _compile(self, spec: StructuredOutputsParams):
        from llguidance import LLMatcher

        try:
            grammar = grammar_text(spec)
        except ValueError as e:
            raise ValueError(f"invalid structured output ({spec.kind}): {e}") from None
        matcher = LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output ({spec.kind}): {_first_line(matcher.get_error())}")
        return matcher


def compile_error(future: Future) -> Exception | None:
    """A finished compilation's error as a new exception for one request (the future's own one is shared by every
    request of that spec, and each raise of a shared exception would lengthen its traceback); None if it compiled."""
    error = future.exception()
    if error is None:
        return None
    if isinstance(error, ValueError):
        return ValueError(str(error))
    return RuntimeError(f"the grammar failed to compile: {error!r}")


def _first_line(message: str) -> str:
    lines = [ln for ln in message.splitlines() if ln.strip()]
    return " ".join(lines[:3]) if lines else "the grammar was rejected"


@dataclass(frozen=True)
class GrammarMasks:
    """One step's allowed tokens for its constrained rows: plain data, so it travels in a StepInput."""

    request_ids: tuple[str, ...]
    bitmask: np.ndarray  # [rows, ceil(vocab / 32)] int32; bit j of word w allows token 32 * w + j
    # speculative decoding: a request with proposals has one row per verified position instead (same words)
    spec_rows: dict[str, np.ndarray] | None = None

    def allowed_rows(self, request_id: str, vocab: int) -> torch.Tensor | None:
        """[positions, vocab] True where the grammar allows a token, at each verified position of `request_id`'s
        proposals (None: the request is not constrained)."""
        words = None if self.spec_rows is None else self.spec_rows.get(request_id)
        if words is None:
            return None
        allowed = ((torch.from_numpy(words).unsqueeze(-1) >> _BITS) & 1).flatten(1).bool()
        if allowed.shape[1] < vocab:
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        return allowed[:, :vocab]

    def apply(self, logits: torch.Tensor, request_ids: Sequence[str]) -> None:
        """In place: tokens the grammar forbids get -inf in the rows (ordered as `request_ids`) it covers."""
        where = {rid: i for i, rid in enumerate(request_ids)}
        pairs = [(where[rid], k) for k, rid in enumerate(self.request_ids) if rid in where]
        if not pairs:
            return
        words = torch.from_numpy(self.bitmask[[k for _, k in pairs]])
        allowed = ((words.unsqueeze(-1) >> _BITS) & 1).flatten(1).bool()
        vocab = logits.shape[1]
        if allowed.shape[1] < vocab:  # logits wider than the tokenizer: the extra ids are never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        idx = torch.tensor([i for i, _ in pairs], device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed[:, :vocab].to(logits.device), float("-inf"))


class GuidedDecoder:
    """The live matchers of constrained sequences (request id -> matcher), owned by one engine."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, Any] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def start(self, request_id: str, pristine: Any, accepted: Sequence[int] = ()) -> None:
        """Give a sequence its own copy of a compiled grammar's matcher, advanced over `accepted` (tokens it
        already took elsewhere, e.g. on the prefill instance of a disaggregated request)."""
        matcher = self._matchers[request_id] = pristine.deep_copy()
        for token in accepted:
            if not matcher.consume_token(token):
                logger.warning("request %s: carried-over token %d rejected by its grammar: %s", request_id, token,
                               _first_line(matcher.get_error()))
                break

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def valid_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` the sequence's grammar would take in a row from where it is (all: unconstrained)."""
        matcher = self._matchers.get(request_id)
        return len(token_ids) if matcher is None or not token_ids else matcher.validate_tokens(list(token_ids))

    def masks(self, request_ids: Sequence[str], proposals: dict[str, Sequence[int]] | None = None
              ) -> GrammarMasks | None:
        """The allowed-token bitmasks of the constrained ones among `request_ids` (None if there are none).

        Computed when a batch is submitted, from matchers that have taken every token sampled so
        far (a request is in one batch in flight at most), so the runner that samples, in this
        process or on a parallel instance's output rank, only applies them.
        """
        if not self._matchers:
            return None
        rows = [(rid, m) for rid in request_ids if (m := self._matchers.get(rid)) is not None]
        if not rows:
            return None
        words = (self.compiler.vocab_size + 31) // 32
        bitmask = np.empty((len(rows), words), dtype=np.int32)
        # Straight into the array's memory (llguidance.torch would import torch.compile: seconds).
        for j, (_, matcher) in enumerate(rows):
            matcher.unsafe_compute_mask_ptr(bitmask[j].ctypes.data, words * 4)
        spec_rows = None
        if proposals:
            spec_rows = {rid: self._position_masks(m, proposals[rid], words) for rid, m in rows if proposals.get(rid)}
        return GrammarMasks(tuple(rid for rid, _ in rows), bitmask, spec_rows)

    @staticmethod
    def _position_masks(matcher, proposals: Sequence[int], words: int) -> np.ndarray:
        """The masks after each prefix of `proposals` (the matcher is left where it was). Proposals come trimmed
        to what the grammar takes (`valid_prefix`); past one it refuses, the rows stay all-allowed: verification
        rejects that proposal at its own position, so no later position is ever sampled."""
        out = np.full((len(proposals) + 1, words), -1, dtype=np.int32)
        consumed = 0
        for i in range(len(proposals) + 1):
            matcher.unsafe_compute_mask_ptr(out[i].ctypes.data, words * 4)
            if i == len(proposals) or not matcher.consume_token(proposals[i]):
                break
            consumed += 1
        if consumed:
            matcher.rollback(consumed)
        return out

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance a sequence's matcher; True when the grammar is complete (nothing but EOS may follow)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.consume_token(token_id):
            logger.warning("request %s: token %d rejected by its grammar: %s", request_id, token_id,
                           _first_line(matcher.get_error()))
            return True
        return matcher.is_stopped()
