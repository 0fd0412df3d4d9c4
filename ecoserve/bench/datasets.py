"""Benchmark workloads: each dataset turns (args, tokenizer, rng) into a list of `SampleRequest`s.

Datasets are registered by name (`DATASETS`); `--dataset-name` picks one.
Without a tokenizer, prompts are token-id lists (for /v1/completions) or plain words (chat),
and lengths are estimates that the server's usage block later corrects.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

# Token ids used when no tokenizer is loadable: well inside every common vocab (32k-256k) and
# past the special/byte tokens that usually sit at the start.
NO_TOKENIZER_ID_RANGE = (1000, 30000)
# Words that are one token in most BPE vocabularies; used for chat prompts without a tokenizer.
_FILLER_WORDS = ("the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "at", "by",
                 "from", "this", "that", "it", "be", "are", "was", "or", "an", "not", "but", "all")


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids for /v1/completions when no tokenizer is loaded
    prompt_len: int  # tokens (exact with a tokenizer, an estimate without)
    expected_output_len: int  # becomes max_tokens


def load_tokenizer(name: str | None) -> Any | None:
    """A HF tokenizer from a local dir/file or the local HF cache; None if not loadable (never downloads)."""
    if not name:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        if name.endswith(".gguf") and os.path.isfile(name):
            return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(name)),
                                                 gguf_file=os.path.basename(name))
        # local_files_only: a hub id not in the cache fails at once instead of retrying the network.
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:  # any loader failure means "count tokens another way"
        return None


def _sample_lens(rng: np.random.Generator, mean_len: int, ratio: float, n: int) -> np.ndarray:
    """Integers uniform in [floor(mean*(1-ratio)), ceil(mean*(1+ratio))], at least 1."""
    lo = max(1, int(np.floor(mean_len * (1 - ratio))))
    hi = max(lo, int(np.ceil(mean_len * (1 + ratio))))
    return rng.integers(lo, hi + 1, size=n)


class _PromptMaker:
    """Builds prompts of a target token length from random token ids."""

    def __init__(self, tokenizer: Any | None, rng: np.random.Generator, as_text: bool):
        self.tokenizer, self.rng, self.as_text = tokenizer, rng, as_text
        if tokenizer is not None:
            special = set(getattr(tokenizer, "all_special_ids", []) or [])
            self.ids = np.array([i for i in range(len(tokenizer)) if i not in special])

    def random_ids(self, n: int) -> list[int]:
        if self.tokenizer is None:
            return self.rng.integers(*NO_TOKENIZER_ID_RANGE, size=n).tolist()
        return self.rng.choice(self.ids, size=n).tolist()

    def make(self, ids: list[int]) -> tuple[str | list[int], int]:
        """(prompt, prompt_len) for roughly these ids."""
        if self.tokenizer is None:
            if not self.as_text:
                return ids, len(ids)
            words = self.rng.choice(_FILLER_WORDS, size=len(ids))
            return " ".join(words), len(ids)
        target = len(ids)
        text = self.tokenizer.decode(ids)
        # Decoding then re-encoding can merge or split tokens; trim/pad once toward the target length.
        re_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(re_ids) != target:
            re_ids = (re_ids + self.random_ids(max(0, target - len(re_ids))))[:target]
            text = self.tokenizer.decode(re_ids)
        return text, len(self.tokenizer.encode(text, add_special_tokens=False))


def _from_lengths(input_lens: np.ndarray, output_lens: np.ndarray, tokenizer: Any | None,
                  rng: np.random.Generator, as_text: bool, prefix_len: int = 0) -> list[SampleRequest]:
    maker = _PromptMaker(tokenizer, rng, as_text)
    prefix = maker.random_ids(prefix_len)  # shared by every prompt, so prefix caching can hit
    out = []
    for in_len, out_len in zip(input_lens, output_lens):
        prompt, plen = maker.make(prefix + maker.random_ids(int(in_len)))
        out.append(SampleRequest(prompt, plen, int(out_len)))
    return out


def random_dataset(args: Any, tokenizer: Any | None, rng: np.random.Generator,
                   as_text: bool) -> list[SampleRequest]:
    """Random token ids: input/output lengths uniform within +-range_ratio of the given lengths."""
    ratio = args.random_range_ratio
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    n = args.num_prompts
    in_lens = _sample_lens(rng, args.random_input_len, ratio, n)
    out_lens = _sample_lens(rng, args.random_output_len, ratio, n)
    return _from_lengths(in_lens, out_lens, tokenizer, rng, as_text, args.random_prefix_len)


# Published mean (input, output) lengths in tokens of the EcoServe paper's workloads.
SYNTHETIC_MEANS = {"alpaca": (20.6, 163.8), "longbench": (2686.9, 101.8)}
# Log-space sigma of the log-normal lengths: CV = sqrt(exp(sigma^2) - 1) ~= 0.53.
SYNTHETIC_SIGMA = 0.5


def lognormal_lens(rng: np.random.Generator, mean: float, n: int, sigma: float = SYNTHETIC_SIGMA) -> np.ndarray:
    """Log-normal integer lengths whose expectation is `mean` (mu = ln(mean) - sigma^2/2), >= 1."""
    mu = np.log(mean) - sigma ** 2 / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size=n))).astype(int)


def _synthetic(name: str) -> Callable[..., list[SampleRequest]]:
    def build(args: Any, tokenizer: Any | None, rng: np.random.Generator, as_text: bool) -> list[SampleRequest]:
        mean_in, mean_out = SYNTHETIC_MEANS[name]
        in_lens = lognormal_lens(rng, mean_in, args.num_prompts)
        out_lens = lognormal_lens(rng, mean_out, args.num_prompts)
        return _from_lengths(in_lens, out_lens, tokenizer, rng, as_text)
    build.__doc__ = (f"{name}: log-normal lengths (sigma {SYNTHETIC_SIGMA}) with the published means "
                     f"{SYNTHETIC_MEANS[name][0]}/{SYNTHETIC_MEANS[name][1]} input/output tokens.")
    return build


def _estimate_tokens(text: str) -> int:
    return max(1, round(len(text) / 4))  # ~4 characters per token for English BPE vocabularies


def _turns(entry: dict) -> list[str]:
    turns = entry.get("conversations", entry.get("conversation", []))
    return [t.get("value", t.get("content", "")) for t in turns]


def sharegpt_dataset(args: Any, tokenizer: Any | None, rng: np.random.Generator,
                     as_text: bool) -> list[SampleRequest]:
    """ShareGPT JSON: first human turn is the prompt, the reply's length is the output length.

    Like the usual methodology, pairs shorter than 4 tokens, prompts over 1024 tokens and
    pairs over 2048 tokens are skipped (unless --sharegpt-output-len fixes the output length).
    """
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path pointing to a ShareGPT JSON file")
    with open(args.dataset_path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [t[:2] for t in map(_turns, data) if len(t) >= 2]
    order = rng.permutation(len(pairs))
    count = (lambda s: len(tokenizer.encode(s, add_special_tokens=False))) if tokenizer else _estimate_tokens
    fixed_out = getattr(args, "sharegpt_output_len", None)
    out: list[SampleRequest] = []
    for i in order:
        if len(out) == args.num_prompts:
            break
        prompt, reply = pairs[i]
        plen = count(prompt)
        olen = fixed_out if fixed_out else count(reply)
        if fixed_out is None and (plen < 4 or olen < 4 or plen > 1024 or plen + olen > 2048):
            continue
        out.append(SampleRequest(prompt, plen, olen))
    if len(out) < args.num_prompts:
        raise ValueError(f"{args.dataset_path} holds only {len(out)} usable conversations, "
                         f"--num-prompts asks for {args.num_prompts}")
    return out


DATASETS: dict[str, Callable[..., list[SampleRequest]]] = {
    "random": random_dataset,
    "sharegpt": sharegpt_dataset,
    "alpaca": _synthetic("alpaca"),
    "longbench": _synthetic("longbench"),
}


def sample_requests(args: Any, tokenizer: Any | None, as_text: bool) -> list[SampleRequest]:
    """The workload named by args.dataset_name; `as_text` forces text prompts (chat endpoints)."""
    if args.dataset_name not in DATASETS:
        raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}; got {args.dataset_name!r}")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    rng = np.random.default_rng(args.seed)
    return DATASETS[args.dataset_name](args, tokenizer, rng, as_text)
