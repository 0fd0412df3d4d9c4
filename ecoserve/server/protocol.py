"""Request bodies of the OpenAI API (plus vLLM's sampling extensions) and their SamplingParams.

Bodies are parsed with pydantic in strict JSON mode, so a wrong type is an error rather than a
silent coercion; unknown fields are ignored, as OpenAI-compatible servers do. Value ranges are
declared on the fields (so /openapi.json documents what is accepted) and a value outside one is a
400 that states the whole range; rules across fields are left to SamplingParams.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from ecoserve.sampling import SEED_MAX, SEED_MIN, SamplingParams
from ecoserve.server.errors import APIError, bad_request
from ecoserve.structured import StructuredOutputsParams

# The limits on a request's fields: each well past what a legitimate request uses, each one past it a 400
# naming the field (docs/server.md, "Limits and protection", has this table for users).
MAX_N = 128  # samples per prompt (vLLM's bound)
MAX_PROMPTS = 256  # prompts in one completions request (a list prompt)
MAX_SAMPLES = 1024  # prompts x n: the sequences one request may start
MAX_STOP_STRINGS = 64  # matched against the text after every token
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 2048  # entries of logit_bias
MAX_TOOLS = 128  # OpenAI's own limit
MAX_MESSAGES = 4096
MAX_GRAMMAR_CHARS = 128 * 1024  # a JSON schema (as JSON), regex, grammar, or all the choices together
MAX_TOKEN_ID = 2**31 - 1  # token ids and top_k fit an int32


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    @classmethod
    def parse(cls, body: bytes) -> Any:
        """Validate a JSON body; a top-level value out of its declared range is a 400 naming the range."""
        try:
            return cls.model_validate_json(body)
        except ValidationError as e:
            first = (e.errors() or [{}])[0]
            loc = first.get("loc", ())
            if first.get("type") in _RANGE_ERRORS and len(loc) == 1 and loc[0] in cls.model_fields:
                name = loc[0]
                raise bad_request(f"{name} must be {_range_text(cls.model_fields[name])}, got {first['input']!r}",
                                  param=name) from None
            raise


def _range_text(info: FieldInfo) -> str:
    """">= 0", "(0, 1]", "[1, 128]": the bounds declared on a field."""
    low = high = None
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            low = f"[{m.ge}", f">= {m.ge}"
        elif isinstance(m, annotated_types.Gt):
            low = f"({m.gt}", f"> {m.gt}"
        elif isinstance(m, annotated_types.Le):
            high = f"{m.le}]", f"<= {m.le}"
        elif isinstance(m, annotated_types.Lt):
            high = f"{m.lt})", f"< {m.lt}"
    if low and high:
        return f"in {low[0]}, {high[0]}"
    return (low or high)[1]


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingBody(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKEN_ID)  # -1 and 0 disable it
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs / older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_common(self, max_model_len: int) -> None:
        """Rules of one field that pydantic does not state: sizes, token lengths, logit_bias entries."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        _at_most("stop", len(stops), MAX_STOP_STRINGS, "strings")
        for s in stops:
            if len(s) > MAX_STOP_STRING_CHARS:
                raise bad_request(f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters, got one "
                                  f"of {len(s)}", param="stop")
        _at_most("stop_token_ids", len(self.stop_token_ids or ()), MAX_STOP_TOKEN_IDS, "token ids")
        _at_most("logit_bias", len(self.logit_bias or ()), MAX_LOGIT_BIAS, "entries")
        self._check_grammar_size()
        for name in ("max_tokens", "max_completion_tokens", "min_tokens"):  # a prompt needs >= 1 token of it
            value = getattr(self, name, None)
            if value is not None and value >= max_model_len:
                raise APIError(400, f"{name} must be less than this model's maximum context length "
                                    f"({max_model_len} tokens), got {value}", param=name,
                               code="context_length_exceeded")
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 10:
                raise bad_request(f"logit_bias keys must be token ids (digit strings), got {key!r}",
                                  param="logit_bias")
            if not -100 <= bias <= 100:
                raise bad_request(f"logit_bias values must be in [-100, 100], got {bias} for token {key}",
                                  param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")

    def _check_grammar_size(self) -> None:
        """A structured-output constraint larger than MAX_GRAMMAR_CHARS is refused before it is compiled."""
        for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            size = len(value) if isinstance(value, str) else len(json.dumps(value))
            if size > MAX_GRAMMAR_CHARS:
                raise bad_request(f"{name} must be at most {MAX_GRAMMAR_CHARS} characters (as JSON), got {size}",
                                  param=name)

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_structure(self) -> tuple[StructuredOutputsParams | None, str]:
        """The one structured-output constraint the body asks for (at most one way of asking), and its field."""
        requests = [("response_format", lambda: _response_format_spec(self.response_format)),
                    ("structured_outputs", lambda: StructuredOutputsParams(**self.structured_outputs)
                     if self.structured_outputs is not None else None)]
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            requests.append((name, lambda name=name, kind=kind: StructuredOutputsParams(
                **{kind: getattr(self, name)}) if getattr(self, name) is not None else None))
        asked: list[tuple[str, StructuredOutputsParams]] = []
        for name, make in requests:
            try:
                spec = make()
            except (TypeError, ValueError) as e:
                raise bad_request(str(e).replace("StructuredOutputsParams.__init__() ", ""), param=name) from None
            if spec is not None:
                asked.append((name, spec))
        if len(asked) > 1:
            raise bad_request(f"give at most one structured-output constraint, got {', '.join(n for n, _ in asked)}",
                              param=asked[1][0])
        return asked[0][1] if asked else None, asked[0][0] if asked else "response_format"

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """Unset fields fall back to the model's generation_config, then to OpenAI's defaults."""
        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        try:
            return SamplingParams(
                n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0), seed=self.seed, presence_penalty=pick("presence_penalty", 0.0),
                frequency_penalty=pick("frequency_penalty", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0), max_tokens=max_tokens,
                min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                structured_outputs=structured)
        except ValueError as e:
            raise _param_error(e) from None


def _at_most(name: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise bad_request(f"{name} may hold at most {limit} {what}, got {count}", param=name)


def _response_format_spec(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text, json_object, or json_schema {name, schema, strict}."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
            raise bad_request("response_format.json_schema must be an object with a `schema` object",
                              param="response_format")
        return StructuredOutputsParams(json=inner.get("schema") or {"type": "object"})
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      param="response_format")


def _param_error(e: ValueError) -> APIError:
    message = str(e)
    field = message.split(" ", 1)[0]
    return bad_request(message, param=field if field.isidentifier() else None)


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None

    def check(self, max_model_len: int) -> None:
        self.check_common(max_model_len)
        num_prompts = len(self.prompts())
        _at_most("prompt", num_prompts, MAX_PROMPTS, "prompts")
        if num_prompts * self.n > MAX_SAMPLES:
            raise bad_request(f"prompts x n may be at most {MAX_SAMPLES} sequences, got {num_prompts} x {self.n}",
                              param="n")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of must equal n ({self.n}) when given, got {self.best_of}", param="best_of")
        if self.prompt in ("", []) or (isinstance(self.prompt, list) and any(p in ("", []) for p in self.prompt)):
            raise bad_request("the prompt is empty: at least one token is needed", param="prompt")

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a string, a list of strings, token ids, or a list of token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: str  # only "function" is served; checked with a clear message in server/tools.py
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self, max_model_len: int) -> None:
        self.check_common(max_model_len)
        _at_most("messages", len(self.messages), MAX_MESSAGES, "messages")
        _at_most("tools", len(self.tools or ()), MAX_TOOLS, "tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise bad_request("continue_final_message needs add_generation_prompt: false and a final assistant "
                              "message", param="continue_final_message")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
