"""Tools on the chat API: `tool_choice` -> how the output is constrained and read, and model text ->
`tool_calls` (whole, or as streamed deltas).

`tool_choice` "required" and a named function constrain the output with a JSON schema built from
the tools' parameter schemas, so the call always parses; "auto" leaves the text free and reads
calls out of it with the server's `--tool-call-parser`; "none" ignores the tools.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from ecoserve.server.errors import bad_request
from ecoserve.server.protocol import ChatTool, NamedToolChoice, ToolChoice
from ecoserve.server.tool_parsers import ParsedOutput, ParsedToolCall, ToolParser
from ecoserve.structured import StructuredOutputsParams


def check_tools(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> None:
    """Unknown tool types, duplicate names and a tool_choice naming a missing function are 400s."""
    names = set()
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            raise bad_request(f"tools[{i}].type must be 'function', got {tool.type!r}", param=f"tools.{i}.type")
        if tool.function.name in names:
            raise bad_request(f"tools[{i}]: the function name {tool.function.name!r} is used twice", param="tools")
        names.add(tool.function.name)
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if not tools:
        raise bad_request(f"tool_choice {_choice_text(tool_choice)} needs tools", param="tool_choice")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise bad_request(f"tool_choice names the function {tool_choice.function.name!r}, which is not in tools "
                          f"({', '.join(sorted(names))})", param="tool_choice")


def _choice_text(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{'function': {choice.function.name!r}}}"


@dataclass
class ToolCalling:
    """How one chat request's output is read: plain text, a named call, a list of calls, or parser-found calls."""

    mode: Literal["text", "named", "required", "auto"]
    function: str | None = None
    parser: ToolParser | None = None

    @classmethod
    def of(cls, tools: list[ChatTool] | None, tool_choice: ToolChoice | None,
           parser: ToolParser | None) -> "ToolCalling":
        if not tools or tool_choice == "none":
            return cls("text")
        if isinstance(tool_choice, NamedToolChoice):
            return cls("named", tool_choice.function.name)
        if tool_choice == "required":
            return cls("required")
        if parser is None:
            raise bad_request("tool_choice 'auto' needs a server started with --tool-call-parser (one of the "
                              "registered formats); or use tool_choice 'required' or a named function",
                              param="tool_choice")
        return cls("auto", parser=parser)

    def constraint(self, requested: tuple[StructuredOutputsParams | None, str], tools: list[ChatTool] | None,
                   tool_choice: ToolChoice | None, parallel: bool) -> tuple[StructuredOutputsParams | None, str]:
        """The output's constraint and the field it came from: the call's JSON schema for "named" and "required",
        else what the request asked for."""
        structured, param = requested
        if self.mode not in ("named", "required"):
            return structured, param
        if structured is not None:
            raise bad_request("a structured-output constraint cannot be combined with tool_choice "
                              f"{self.mode!r}: the tool call decides the output's shape", param="tool_choice")
        return tool_call_spec(tools, tool_choice, parallel), "tools"

    def template_tools(self, tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model: none when the output is plain text."""
        return [t.model_dump(exclude_none=True) for t in tools] if self.mode != "text" else None

    def parse(self, text: str) -> ParsedOutput:
        if self.mode == "text":
            return ParsedOutput(text, [])
        if self.mode == "named":
            return ParsedOutput(None, [ParsedToolCall(self.function, text)])
        if self.mode == "required":
            try:
                calls = [ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                         for c in json.loads(text)]
            except (ValueError, KeyError, TypeError):  # cut short by max_tokens: keep the text
                return ParsedOutput(text, [])
            return ParsedOutput(None, calls)
        return self.parser.parse(text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished choice, and its finish_reason."""
        parsed = self.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = [_call_dict(c) for c in parsed.tool_calls]
        return message, self.finish_reason(bool(parsed.tool_calls), finish_reason)

    def finish_reason(self, called: bool, finish_reason: str | None) -> str | None:
        """"tool_calls" for an output that stopped after calling tools; a named call keeps "stop", as in OpenAI."""
        return "tool_calls" if called and self.mode != "named" and finish_reason == "stop" else finish_reason


@dataclass
class ToolStream:
    """Per-choice streaming: content deltas as they become safe, tool calls once they are complete.

    A named call streams its arguments as they are generated; other calls are sent whole, each
    in one delta, when the output ends (what OpenAI clients accumulate is the same). It is fed the
    text deltas; only the "auto" and "required" modes keep the text, to find and parse the calls.
    """

    calling: ToolCalling
    _sent: int = 0  # characters of text already sent as content
    _opened: bool = False
    _text: str = ""
    finished_with_calls: bool = field(default=False, init=False)

    def deltas(self, new_text: str, final: bool) -> list[dict[str, Any]]:
        mode = self.calling.mode
        if mode == "text":
            return [{"content": new_text}] if new_text else []
        if mode == "named":
            out = []
            if not self._opened:
                self._opened = True
                out.append({"tool_calls": [{"index": 0, "id": _new_call_id(), "type": "function",
                                            "function": {"name": self.calling.function, "arguments": ""}}]})
            if new_text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]})
            return out
        self._text += new_text
        text = self._text
        if mode == "auto" and not final:
            parser = self.calling.parser
            start = parser.tool_start(text)
            safe = start if start is not None else len(text) - parser.held_back(text)
            return self._content(text, safe)
        if not final:
            return []
        parsed = self.calling.parse(text)
        if not parsed.tool_calls:
            return self._content(text, len(text))
        start = self.calling.parser.tool_start(text) if mode == "auto" else 0
        out = self._content(text, start) if text[self._sent:start].strip() else []
        self.finished_with_calls = True
        out.extend({"tool_calls": [_call_dict(c, i)]} for i, c in enumerate(parsed.tool_calls))
        return out

    def _content(self, text: str, upto: int) -> list[dict[str, Any]]:
        if upto <= self._sent:
            return []
        piece, self._sent = text[self._sent:upto], upto
        return [{"content": piece}]


def tool_call_spec(tools: list[ChatTool], tool_choice: ToolChoice, parallel: bool) -> StructuredOutputsParams:
    """The JSON the output must be: the named function's arguments, or a list of {name, parameters} calls."""
    if isinstance(tool_choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return StructuredOutputsParams(json=_parameters(tool))
    one_call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                            "parameters": _parameters(t)},
                           "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_dict(call: ParsedToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": _new_call_id(), "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out["index"] = index
    return out
