"""Sampling parameters: vLLM's names and defaults, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass

from ecoserve.structured import StructuredOutputsParams

# A seed is an int64, as vLLM's protocol bounds it; torch.Generator.manual_seed accepts every one.
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1


@dataclass
class SamplingParams:
    """How to sample one request's output. Errors name the offending field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per output token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # A JSON schema, regex, choice list or grammar the output must match (plain data: see ecoserve.structured).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # as deserialized from a message
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                               for k, v in self.logit_bias.items()}
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def validate(self) -> None:
        """Check every field again: params mutated after construction are refused before they reach a step."""
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, name: str, rule: str, value: object) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool), name, "a number", value)
        need(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        need(self.temperature >= 0.0, "temperature", ">= 0", self.temperature)
        need(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        need(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "-1, 0 (disabled) or a positive integer", self.top_k)
        need(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        need(self.repetition_penalty > 0.0, "repetition_penalty", "> 0", self.repetition_penalty)
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "max_tokens", "an integer >= 1 or None", self.max_tokens)
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "an integer >= 0", self.min_tokens)
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             "logprobs", "None or an integer in [0, 20]", self.logprobs)
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs", "None or an integer in [0, 20]", self.prompt_logprobs)
        need(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and SEED_MIN <= self.seed <= SEED_MAX),
             "seed", f"None or an integer in [{SEED_MIN}, {SEED_MAX}]", self.seed)
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings", self.stop)
        need(self.detokenize or not self.stop, "stop", "empty when detokenize=False (stop strings are matched on text)",
             self.stop)
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", "a list of non-negative integers", self.stop_token_ids)

        need(self.logit_bias is None or all(
            isinstance(k, int) and k >= 0 and isinstance(v, (int, float)) and -100 <= v <= 100
            for k, v in self.logit_bias.items()),
            "logit_bias", "a map of token ids (>= 0) to biases in [-100, 100]", self.logit_bias)
        need(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "None or a StructuredOutputsParams", self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_processing(self) -> bool:
        """True when the logits row must be edited before the argmax (penalties or a bias)."""
        return self.needs_penalties or bool(self.logit_bias)

    def clone(self, **changes) -> "SamplingParams":
        from dataclasses import replace
        return replace(self, **changes)
