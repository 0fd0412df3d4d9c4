"""A request as the scheduler sees it, and the outputs the engine hands back to users."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ecoserve.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class RequestTimes:
    """Timestamps read from the scheduler's Clock (wall time live, virtual time simulated)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class LoRARequest:
    """One LoRA adapter, named as vLLM names it: `lora_int_id` (>= 1) keys slots and the prefix cache, and
    `base_model_name`, when given, must be the engine's model."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


@dataclass(eq=False)
class Request:
    """One sequence: its tokens and how many of them have KV computed.

    The scheduler's single invariant: each step, `num_computed_tokens` catches up with
    `num_tokens` within a token budget; whenever it reaches `num_tokens` a new token is sampled.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    lora_request: LoRARequest | None = None  # None: the base model
    times: RequestTimes = field(init=False)
    _output_limit: int | None = field(default=None, init=False, repr=False)  # max_output_tokens, once known

    def __post_init__(self) -> None:
        self.times = RequestTimes(arrival=self.arrival_time)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def lora_id(self) -> int:
        """The adapter's `lora_int_id`; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def max_output_tokens(self) -> int:
        limit = self.sampling_params.max_tokens
        if self.max_model_len is not None:
            room = self.max_model_len - self.num_prompt_tokens
            limit = room if limit is None else min(limit, room)
        return max(limit if limit is not None else 1 << 30, 0)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop_token(self) -> RequestStatus | None:
        """Finish on length, EOS or a stop token id (stop strings are checked by the detokenizer)."""
        params = self.sampling_params
        out = self.output_token_ids
        n_out = len(out)  # not the property: this runs once per request per step
        if n_out == 0:
            return None
        last = out[-1]
        if n_out >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        limit = self._output_limit
        if limit is None:  # fixed once tokens are sampled (max_model_len is set when the request is added)
            limit = self._output_limit = self.max_output_tokens
        if n_out >= limit:
            return RequestStatus.FINISHED_LENGTH
        return None


Logprobs = dict[int, float]  # token id -> logprob, for one position


@dataclass(eq=False)
class OutputHistory:
    """Everything one sample has emitted so far. Append-only, so an output is a snapshot of its lengths.

    The engine keeps one per sample; a consumer that receives deltas from another process can
    keep its own and build the same `CompletionOutput`s.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    _pieces: list[str] = field(default_factory=list)
    _text: str = ""  # the first `_num_joined` pieces, joined on demand
    _num_joined: int = 0
    num_chars: int = 0

    def extend(self, token_ids: list[int], text: str, logprobs: list[Logprobs] | None) -> None:
        self.token_ids.extend(token_ids)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)
        if text:
            self._pieces.append(text)
            self.num_chars += len(text)

    def text(self, num_chars: int) -> str:
        """The first `num_chars` characters emitted; joins only the pieces added since the last call."""
        if self._num_joined < len(self._pieces):
            self._text += "".join(self._pieces[self._num_joined:])
            self._num_joined = len(self._pieces)
        return self._text[:num_chars]


@dataclass(eq=False)
class CompletionOutput:
    """One sample's output after one step: what is new (`new_*`), and cumulative views built on demand.

    Each step costs O(new tokens): `text`, `token_ids` and `logprobs` are computed only when read,
    from the sample's `OutputHistory` cut at the lengths it had when this output was made.
    """

    index: int
    new_text: str
    new_token_ids: list[int]
    cumulative_logprob: float | None
    new_logprobs: list[Logprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    history: OutputHistory | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.history is None:  # a standalone output: its deltas are all there is
            self.history = OutputHistory()
            self.history.extend(self.new_token_ids, self.new_text, self.new_logprobs)
        self.num_tokens = len(self.history.token_ids)
        self._num_chars = self.history.num_chars
        self._num_logprobs = None if self.history.logprobs is None else len(self.history.logprobs)

    @property
    def text(self) -> str:
        return self.history.text(self._num_chars)

    @property
    def token_ids(self) -> list[int]:
        return self.history.token_ids[:self.num_tokens]

    @property
    def logprobs(self) -> list[Logprobs] | None:
        if self._num_logprobs is None:
            return None
        return self.history.logprobs[:self._num_logprobs]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """Shaped like vLLM's RequestOutput. `prompt_logprobs` is the engine's own list, shared rather than copied
    each step; it is complete once the prompt has been computed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[Logprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
