"""Tool-call parsers and the streaming of tool calls, on fixed model texts."""
from __future__ import annotations

import json

import pytest

from ecoserve.server.errors import APIError
from ecoserve.server.chat import template_message
from ecoserve.server.tool_parsers import TOOL_PARSERS, get_tool_parser
from ecoserve.server.protocol import ChatMessage, ChatTool, NamedToolChoice
from ecoserve.server.tools import ToolCalling, ToolStream, tool_call_spec


def calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_hermes_and_qwen_several_calls_with_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>')
    for name in ("hermes", "qwen2_5"):
        parsed = get_tool_parser(name).parse(text)
        assert parsed.content == "Let me check."
        assert calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    # an unclosed final block (the output ended) still parses
    parsed = get_tool_parser("hermes").parse('<tool_call>{"name": "f", "arguments": {}}')
    assert parsed.content is None and calls(parsed) == [("f", {})]


@pytest.mark.parametrize("text", [
    'Sure <tool_call>{"name": "f", "arguments": {"a": </tool_call>',  # bad JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f"}</tool_call> and then more words',  # text after the calls
    'no tool call at all',
])
def test_hermes_malformed_text_stays_content(text):
    parsed = get_tool_parser("hermes").parse(text)
    assert parsed.content == text and parsed.tool_calls == []


def test_llama3_json():
    parser = get_tool_parser("llama3_json")
    parsed = parser.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert parsed.content is None and calls(parsed) == [("a", {"x": 1}), ("b", {})]
    assert calls(parser.parse(' {"name": "a", "arguments": {"y": 2}}')) == [("a", {"y": 2})]
    for text in ('The answer is {"name": "a"}', '{"name": "a", "parameters": {', '{"nom": "a"}'):
        assert parser.parse(text).content == text and not parser.parse(text).tool_calls
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json", "qwen2_5"}
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def _stream(calling, pieces):
    stream, deltas = ToolStream(calling), []
    for i, piece in enumerate(pieces):
        deltas += stream.deltas(piece, final=i == len(pieces) - 1)
    return stream, deltas


def test_auto_streaming_sends_content_then_whole_calls():
    calling = ToolCalling("auto", parser=get_tool_parser("hermes"))
    pieces = ["Hi", " there <tool", '_call>{"name": "f", ', '"arguments": {"a": 1}}</tool_call>']
    stream, deltas = _stream(calling, pieces)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Hi there "  # "<tool" was held back: it could have started a call
    tool = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [(t["index"], t["function"]["name"], json.loads(t["function"]["arguments"])) for t in tool] == [
        (0, "f", {"a": 1})]
    assert stream.finished_with_calls
    # "<tool" that never becomes a call is sent in the end
    stream, deltas = _stream(calling, ["a <tool", "s> b"])
    assert "".join(d.get("content", "") for d in deltas) == "a <tools> b" and not stream.finished_with_calls


def test_named_streaming_sends_arguments_as_generated():
    _, deltas = _stream(ToolCalling("named", "f"), ['{"a"', ": 1}"])
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"a": 1}'


def test_required_schema_and_parse():
    tools = [ChatTool(type="function", function={"name": "f", "parameters": {"type": "object"}}),
             ChatTool(type="function", function={"name": "g"})]
    spec = tool_call_spec(tools, "required", parallel=False)
    assert spec.json["maxItems"] == 1 and [o["properties"]["name"]["const"] for o in spec.json["items"]["anyOf"]] == [
        "f", "g"]
    named = tool_call_spec(tools, NamedToolChoice(type="function", function={"name": "g"}), parallel=True)
    assert named.json == {"type": "object", "properties": {}}
    message, reason = ToolCalling("required").message('[{"name": "g", "parameters": {}}]', "stop")
    assert reason == "tool_calls" and message["tool_calls"][0]["function"] == {"name": "g", "arguments": "{}"}
    message, reason = ToolCalling("required").message('[{"name": "g", "param', "length")
    assert reason == "length" and message["content"] == '[{"name": "g", "param' and "tool_calls" not in message


def test_history_messages_for_the_template():
    msg = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}])
    assert template_message(msg)["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    tool = template_message(ChatMessage(role="tool", content="42", tool_call_id="call_1"))
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    with pytest.raises(APIError, match="not valid JSON"):
        template_message(ChatMessage(role="assistant", tool_calls=[{"id": "x", "function": {"arguments": "{"}}]))
