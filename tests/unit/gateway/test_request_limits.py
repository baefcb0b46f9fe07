"""Request bodies past what kvserve serves are refused naming the field: numbers out
of range, fields kvserve would otherwise ignore, JSON nested too deep."""

import json

import pytest

from services.gateway.errors import InvalidParameterError
from services.gateway.openai_protocol import parse_chat_request, parse_completion_request
from services.gateway.request_limits import MAX_JSON_DEPTH, decode_body, json_depth

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "m", "prompt": "Hi"}


def param_of(parse, body) -> str | None:
    with pytest.raises(InvalidParameterError) as e:
        parse(body)
    return e.value.param


@pytest.mark.parametrize("field, value", [
    ("seed", 2**64), ("seed", 10**30), ("seed", -(2**63) - 1), ("seed", 2**63),
    ("top_k", 2**64), ("top_k", -2), ("max_tokens", 2**64), ("max_tokens", 2**31),
    ("max_completion_tokens", 10**30), ("n", 2**64), ("temperature", 10**400), ("temperature", -1e-9),
    ("temperature", 100.5), ("top_p", 0), ("top_p", 1.0000001), ("top_p", -(10**400)),
])  # fmt: skip
def test_numbers_out_of_range_name_their_field(field, value):
    assert param_of(parse_chat_request, {**CHAT, field: value}) == field


@pytest.mark.parametrize("field, value, param", [
    ("stop_token_ids", [5, 2**64], "stop_token_ids[1]"),
    ("stop_token_ids", [-1], "stop_token_ids[0]"),
    ("prompt", [1, 2**64], "prompt[1]"),
    ("prompt", [[-3]], "prompt[0]"),
])  # fmt: skip
def test_array_items_out_of_range_name_their_index(field, value, param):
    assert param_of(parse_completion_request, {**COMPLETION, field: value}) == param


def test_the_edges_of_every_range_are_accepted():
    edges = {"seed": -(2**63), "top_k": 2**31 - 1, "max_tokens": 2**31 - 1, "temperature": 100, "top_p": 1}
    req = parse_chat_request({**CHAT, **edges})
    assert (req.seed, req.top_k, req.max_tokens, req.temperature, req.top_p) == (-(2**63), 2**31 - 1, 2**31 - 1,
                                                                                100.0, 1.0)  # fmt: skip
    assert parse_chat_request({**CHAT, "seed": 2**63 - 1, "stop_token_ids": [0, 2**31 - 1]}).seed == 2**63 - 1


def test_a_huge_number_is_not_echoed_whole():
    with pytest.raises(InvalidParameterError) as e:
        parse_chat_request({**CHAT, "seed": 10**4000})
    assert len(str(e.value)) < 200 and e.value.param == "seed"


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("store", True),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy"}), ("reasoning_effort", "low"),
    ("best_of", True), ("echo", True), ("suffix", "end"),
])  # fmt: skip
def test_features_kvserve_does_not_implement_are_refused(field, value):
    assert param_of(parse_chat_request, {**CHAT, field: value}) == field


def test_their_off_values_and_harmless_hints_are_accepted():
    body = {
        **CHAT, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {},
        "logprobs": False, "top_logprobs": 0, "frequency_penalty": 0.0, "presence_penalty": 0, "store": False,
        "modalities": ["text"], "audio": None, "user": "u-1", "metadata": {"k": "v"}, "service_tier": "auto",
        "parallel_tool_calls": True, "safety_identifier": "s", "prompt_cache_key": "p",
        "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False},
    }  # fmt: skip
    req = parse_chat_request(body)
    assert req.include_usage and req.stream


@pytest.mark.parametrize("parse, body, param", [
    (parse_chat_request, {**CHAT, "foo": 1}, "foo"),
    (parse_chat_request, {**CHAT, "prompt": "x"}, "prompt"),
    (parse_completion_request, {**COMPLETION, "messages": CHAT["messages"]}, "messages"),
    (parse_completion_request, {**COMPLETION, "max_completion_tokens": 5}, "max_completion_tokens"),
    (parse_chat_request, {**CHAT, "stream": True, "stream_options": {"chunk_size": 4}}, "stream_options.chunk_size"),
    (parse_chat_request, {**CHAT, "user": 5}, "user"),
    (parse_chat_request, {**CHAT, "n": 1.0}, "n"),
])  # fmt: skip
def test_unrecognized_fields_are_refused_as_openai_refuses_them(parse, body, param):
    assert param_of(parse, body) == param


def test_unrecognized_field_message_reads_like_openai():
    with pytest.raises(InvalidParameterError, match=r"^Unrecognized request argument supplied: foo$"):
        parse_chat_request({**CHAT, "foo": 1})


@pytest.mark.parametrize("text, depth", [
    ("1", 0), ("{}", 1), ('[[1], {"a": [2]}]', 3), ('{"a": "[[[[\\"[[[{{{"}', 1), ('{"a": "x\\\\", "b": [[]]}', 3),
    ('["\\\\\\"[["]', 1), ('"]]]]"', 0),
])  # fmt: skip
def test_json_depth_counts_only_brackets_outside_strings(text, depth):
    json.loads(text)  # each case is valid JSON
    assert json_depth(text.encode()) == depth


def test_a_body_nested_past_the_limit_is_refused_before_decoding():
    at_limit = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert decode_body(at_limit) == json.loads(at_limit)
    for deep in (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), b'{"a":' * 2000 + b"1" + b"}" * 2000):
        with pytest.raises(InvalidParameterError, match="nests deeper than"):
            decode_body(deep)
    # many brackets side by side are not deep
    assert decode_body(b"[" + b",".join([b"[]"] * 1000) + b"]") == [[]] * 1000
