"""Incremental detokenization with stop strings, for one output sequence.

Each new token is decoded together with the few tokens before it (a window from
`prefix_offset`), so that tokenizers whose pieces depend on their neighbours (leading spaces,
byte-level merges) decode as they would in the full text; the window grows only while its
text ends in an unfinished UTF-8 character, so a token costs O(1) decoding work. Only a short
pending tail (what may still start a stop string) is kept; released text belongs to the caller,
so a token also costs O(1) string work however long the output grows.
"""
from __future__ import annotations

from typing import Any, Sequence

from ecoserve.sampling import SamplingParams

# Prompt tokens decoded as left context for the first output token.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text and watches for stop strings.

    `tokenizer` is a transformers tokenizer or a `tokenizers.Tokenizer`: anything with
    `decode(ids, skip_special_tokens=...)`.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.stop: list[str] = list(params.stop) if params.detokenize else []
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._skip_special = params.skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pending = ""  # decoded, not yet released: the only text a stop string can still cut
        self._flushed = False
        self._num_tokens = 0
        self.stop_reason: str | None = None  # the stop string that ended the text, if any

    @classmethod
    def resumed(cls, tokenizer: Any, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                params: SamplingParams, num_chars_released: int) -> "IncrementalDetokenizer":
        """The detokenizer of a sequence continued elsewhere, in the state its first one had after
        `output_token_ids`, of whose text `num_chars_released` characters were released.

        The ids are replayed (without stop checks: they ran where the ids were produced), so the next
        token decodes with the same left context, an unfinished multi-byte character completes as it
        would have, and a held-back tail that may start a stop string is still held back. `params`
        count min_tokens from here on, as the continued request does.
        """
        det = cls(tokenizer, prompt_token_ids, params)
        if not params.detokenize:
            return det
        for token_id in output_token_ids:
            det._ids.append(token_id)
            det._pending += det._decode_new(final=False)
        det._pending = det._pending[num_chars_released:]
        return det

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def append(self, token_id: int) -> str | None:
        """Add one output token; returns the stop string if one now appears in the text.

        Like stop token ids, stop strings count only once min_tokens tokens are out; one
        completed earlier stays ordinary text.
        """
        if self.stop_reason is not None or not self.params.detokenize:
            return None
        self._ids.append(token_id)
        self._num_tokens += 1
        return self._add_text(self._decode_new(final=False))

    def take_new_text(self, final: bool = False) -> str:
        """The text that became safe to show since the last call.

        While not final, any tail that may start a stop string is held back. `final=True` means
        no more tokens will come: undecodable bytes left at the end are flushed (as U+FFFD, like
        a full decode) and nothing is held back any more. Released text is never taken back: a
        stop string can only match in text that was held back.
        """
        if final and not self._flushed and self.stop_reason is None and self.params.detokenize:
            self._flushed = True
            self._add_text(self._decode_new(final=True))
        pending = self._pending
        if not pending:
            return ""
        keep = 0 if final or self.stop_reason is not None or not self.stop else self._held_back()
        new, self._pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
        return new

    # -- internals ---------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens after `read_offset`, or "" while it ends mid-character."""
        if self._read_offset == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(self._ids[self._prefix_offset:])
        if after.endswith(_REPLACEMENT) and not final:
            return ""  # an unfinished multi-byte character: wait for its remaining bytes
        # The left context decodes the same with or without the new tokens (it ends on a
        # whole character), so the new text is what follows it.
        new = after[len(before):]
        if new:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        elif after == before:
            # The new tokens decode to nothing (e.g. skipped special tokens): don't let the
            # window grow on their account.
            self._read_offset = len(self._ids)
        return new

    def _add_text(self, new: str) -> str | None:
        if not new:
            return None
        start = len(self._pending)
        self._pending += new
        if not self.stop or self._num_tokens < self.params.min_tokens:
            return None
        # A new match must end inside the new text, so it starts at most (len - 1) before it.
        search_from = max(0, start - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = self._pending.find(s, search_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return None
        pos, s = best
        self._pending = self._pending[: pos + len(s)] if self.params.include_stop_str_in_output else self._pending[:pos]
        self.stop_reason = s
        return s

    def _held_back(self) -> int:
        """Length of the longest pending suffix that is a proper prefix of some stop string."""
        text = self._pending
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
