"""response_format and tools at the door: what a request's fields become (a grammar,
a ToolUse), what is refused and with which param, how tools reach the prompt, and
how the model's text becomes tool calls."""

import json

import pytest

from libs.engine.model.grammar import check_grammar
from libs.protocol.sampling_params import Grammar
from services.gateway.errors import InvalidParameterError
from services.gateway.openai_protocol import parse_chat_request, parse_completion_request
from services.gateway.response_bodies import Choice, ResponseBodies, Usage
from services.gateway.tools import DEFAULT_FORMAT, ToolUse, render_messages

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def param_of(body: dict) -> str | None:
    with pytest.raises(InvalidParameterError) as e:
        parse_chat_request(body)
    return e.value.param


def test_response_formats_become_grammars_keeping_the_schemas_key_order():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    req = parse_chat_request({**CHAT, "response_format": spec})
    assert req.grammar == Grammar(kind="json_schema", schema=json.dumps(schema, separators=(",", ":")), strict=True)
    assert parse_chat_request({**CHAT, "response_format": {"type": "json_object"}}).grammar == Grammar(kind="json_object")
    assert parse_chat_request({**CHAT, "response_format": {"type": "text"}}).grammar is None
    completion = parse_completion_request({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}})
    assert completion.grammar == Grammar(kind="json_object")


@pytest.mark.parametrize("response_format, param", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": []}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"description": "x" * 70000}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}, "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "a", "extra": 1}}, "response_format.json_schema.extra"),
    ({"type": "json_object", "json_schema": {}}, "response_format.json_schema"),
])  # fmt: skip
def test_bad_response_formats_name_the_field(response_format, param):
    assert param_of({**CHAT, "response_format": response_format}) == param


@pytest.mark.parametrize("fields, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "20C"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                          "arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])  # fmt: skip
def test_bad_tool_requests_name_the_field(fields, param):
    assert param_of({**CHAT, **fields}) == param


def test_tool_choice_sets_what_the_answer_must_be():
    assert parse_chat_request({**CHAT, "tools": [WEATHER]}).tool_use == ToolUse((WEATHER,), "auto")
    none = parse_chat_request({**CHAT, "tools": [WEATHER], "tool_choice": "none"})
    assert none.tool_use is None and none.tools == (WEATHER,) and none.grammar is None
    named = parse_chat_request({**CHAT, "tools": [WEATHER, TIME], "parallel_tool_calls": False,
                                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})  # fmt: skip
    assert named.tool_use == ToolUse((WEATHER, TIME), "function", "get_weather", parallel=False)
    schema = json.loads(named.grammar.schema)
    assert schema["properties"] == {"name": {"const": "get_weather"}, "arguments": PARAMS}
    required = parse_chat_request({**CHAT, "tools": [WEATHER, TIME], "tool_choice": "required"})
    options = json.loads(required.grammar.schema)["anyOf"]
    assert [o["properties"]["name"] for o in options] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert options[1]["properties"]["arguments"] == {"type": "object"}
    check_grammar(required.grammar)  # xgrammar compiles it


def test_history_with_calls_and_tool_results_is_accepted():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*CHAT["messages"], {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "20C"}]  # fmt: skip
    req = parse_chat_request({**CHAT, "messages": messages, "tools": [WEATHER]})
    assert req.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert req.messages[2] == {"role": "tool", "content": "20C", "tool_call_id": "call_1"}


def test_the_default_format_puts_the_tools_in_the_system_message_and_calls_in_the_text():
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "20C", "tool_call_id": "c"}]  # fmt: skip
    out = render_messages(messages, (WEATHER,), template_takes_tools=False)
    listing = DEFAULT_FORMAT.format(tools=json.dumps(WEATHER))
    assert out[0] == {"role": "system", "content": f"Be brief.\n\n{listing}"}
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert out[3] == {"role": "tool", "content": "20C"}
    assert render_messages(messages[1:2], (WEATHER,), False)[0] == {"role": "system", "content": listing}
    structured = render_messages(messages, (WEATHER,), template_takes_tools=True)
    assert structured[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_calls_are_parsed_from_the_text():
    auto = ToolUse((WEATHER, TIME))
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = auto.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert len(ToolUse((WEATHER,), parallel=False).parse(text)[1]) == 1
    assert auto.parse("Just text.") == ("Just text.", [])
    assert auto.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    forced = ToolUse((WEATHER,), "required")
    content, [call] = forced.parse('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert content == "" and (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')
    assert forced.parse('{"name": "get_weather", "argu') == ('{"name": "get_weather", "argu', [])  # cut short


def test_a_choice_with_calls_has_them_in_its_message_and_no_content():
    bodies = ResponseBodies("id", "m", is_chat=True)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = bodies.completion_of([Choice("", "tool_calls", tool_calls=[call])], Usage(3, 2, 0))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None, "refusal": None,
                                             "tool_calls": [call]}  # fmt: skip
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert bodies.finish_chunk("tool_calls")["choices"][0]["delta"] == {}
    assert bodies.tool_calls_chunk([{"index": 0, **call}])["choices"][0]["delta"] == {"tool_calls": [{"index": 0, **call}]}
