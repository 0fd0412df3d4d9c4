"""Tool-call parsers for `tool_choice: "auto"`: model text -> (content, tool calls), registered by name.

Chosen with `--tool-call-parser` as in vLLM. A parser that cannot make sense of the text (bad
JSON, a call without a name) returns the whole text as content and no calls, so nothing the
model wrote is lost. For streaming, `tool_start` tells where tool-call text begins, so content
before it can be sent as it comes and the calls once the output is complete.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ParsedToolCall]


class ToolParser:
    """Base: a format whose calls begin with `marker`; subclasses turn the text after it into calls."""

    marker = ""

    def tool_start(self, text: str) -> int | None:
        """Index where tool-call text begins, or None if none has begun (so far)."""
        pos = text.find(self.marker)
        return pos if pos >= 0 else None

    def held_back(self, text: str) -> int:
        """How many trailing characters might be the start of a marker (not safe to send yet)."""
        for n in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-n:]):
                return n
        return 0

    def parse(self, text: str) -> ParsedOutput:
        start = self.tool_start(text)
        if start is None:
            return ParsedOutput(text, [])
        try:
            calls = self.parse_calls(text[start:])
        except (ValueError, KeyError, TypeError, AttributeError):
            calls = []
        if not calls:
            return ParsedOutput(text, [])
        content = text[:start].strip()
        return ParsedOutput(content or None, calls)

    def parse_calls(self, text: str) -> list[ParsedToolCall]:
        raise NotImplementedError


def _call(obj: Any, args_keys: tuple[str, ...]) -> ParsedToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("a tool call needs a name")
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be an object")
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes, Qwen2.5)."""

    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse_calls(self, text: str) -> list[ParsedToolCall]:
        calls = [_call(json.loads(body), ("arguments", "parameters")) for body in self._block.findall(text)]
        rest = self._block.sub("", text).strip()
        if rest:  # text between or after the calls would be lost: not a clean tool-call output
            raise ValueError("text outside tool-call blocks")
        return calls


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, several joined by `;`, optionally after
    `<|python_tag|>`; only when the output starts with one (vLLM's `llama3_json`)."""

    marker = "<|python_tag|>"

    def tool_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.marker) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if not stripped or self.marker.startswith(stripped) else 0

    def parse_calls(self, text: str) -> list[ParsedToolCall]:
        text = text.strip().removeprefix(self.marker).strip()
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(text):
            obj, end = decoder.raw_decode(text, pos)
            calls.append(_call(obj, ("parameters", "arguments")))
            pos = end
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
        return calls


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen2_5": HermesToolParser,  # Qwen2.5's template writes Hermes-style <tool_call> blocks
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
