"""Request bodies parse into exactly what was asked, bad ones name their field,
and response bodies are byte-for-byte OpenAI's shape."""

import pytest

from services.gateway import sse
from services.gateway.errors import InvalidParameterError
from services.gateway.openai_protocol import GenerateRequest, parse_chat_request, parse_completion_request
from services.gateway.response_bodies import ResponseBodies, Usage

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def test_a_minimal_chat_request_gets_openai_defaults():
    assert parse_chat_request(CHAT) == GenerateRequest(model="m", messages=[{"role": "user", "content": "Hi"}])


def test_every_supported_field_is_read():
    req = parse_chat_request({
        **CHAT, "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 42, "stop": "END",
        "stop_token_ids": [5, 6], "ignore_eos": True, "n": 1, "stream": True, "stream_options": {"include_usage": True},
        "user": "alice", "presence_penalty": 0, "logprobs": False,
    })  # fmt: skip
    assert req == GenerateRequest(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=7, temperature=0.0, top_p=0.5, top_k=3,
        seed=42, stop=("END",), stop_token_ids=(5, 6), ignore_eos=True, stream=True, include_usage=True,
        user="alice",  # read for session affinity
    )  # fmt: skip


def test_the_sampling_controls_are_read():
    req = parse_chat_request({
        **CHAT, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1,
        "min_tokens": 3, "logit_bias": {"7": -100, "42": 2.5}, "logprobs": True, "top_logprobs": 5,
    })  # fmt: skip
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty, req.min_p, req.min_tokens) == (
        0.5, -1.0, 1.2, 0.1, 3)  # fmt: skip
    assert req.logit_bias == {7: -100.0, 42: 2.5} and req.logprobs == 5
    assert parse_chat_request({**CHAT, "logprobs": True}).logprobs == 0  # the sampled token's alone
    assert parse_chat_request({**CHAT, "logprobs": False, "top_logprobs": 0}).logprobs is None
    assert parse_completion_request({"model": "m", "prompt": "x", "logprobs": 20}).logprobs == 20
    assert parse_completion_request({"model": "m", "prompt": "x", "logprobs": 0}).logprobs == 0


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse_chat_request({**CHAT, "max_tokens": 5, "max_completion_tokens": 9}).max_tokens == 9


@pytest.mark.parametrize("top_k", [0, -1, None])
def test_vllm_top_k_zero_and_minus_one_mean_no_cut(top_k):
    assert parse_chat_request({**CHAT, "top_k": top_k}).top_k is None


def test_text_content_parts_are_joined_and_names_kept():
    req = parse_chat_request({"model": "m", "messages": [
        {"role": "system", "content": None},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]})  # fmt: skip
    assert req.messages == [{"role": "system", "content": ""}, {"role": "user", "content": "a\nb", "name": "ann"}]


@pytest.mark.parametrize("prompt, expected", [
    ("Once", "Once"), (["Once"], "Once"), ([1, 2, 3], [1, 2, 3]), ([[1, 2]], [1, 2]), ([], []),
])  # fmt: skip
def test_completion_prompts(prompt, expected):
    req = parse_completion_request({"model": "m", "prompt": prompt})
    assert req.prompt == expected and req.messages is None and not req.is_chat


BAD_CHAT = [
    ([], None),
    ({"messages": CHAT["messages"]}, "model"),
    ({"model": 3, "messages": CHAT["messages"]}, "model"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": "Hi"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": ["Hi"]}, "messages[0]"),
    ({"model": "m", "messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_tokens": "5"}, "max_tokens"),
    ({**CHAT, "max_tokens": 5.0}, "max_tokens"),
    ({**CHAT, "max_tokens": True}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "top_p": [1]}, "top_p"),
    ({**CHAT, "top_k": 1.5}, "top_k"),
    ({**CHAT, "seed": "x"}, "seed"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({**CHAT, "stream": True, "stream_options": []}, "stream_options"),
    ({**CHAT, "stop": 5}, "stop"),
    ({**CHAT, "stop": ["a", 1]}, "stop"),
    ({**CHAT, "stop_token_ids": ["a"]}, "stop_token_ids"),
    ({**CHAT, "stop_token_ids": 7}, "stop_token_ids"),
    ({**CHAT, "ignore_eos": "no"}, "ignore_eos"),
    ({**CHAT, "logprobs": 1}, "logprobs"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools[0]"),
    ({**CHAT, "presence_penalty": "0.5"}, "presence_penalty"),
    ({**CHAT, "presence_penalty": 3}, "presence_penalty"),
    ({**CHAT, "logit_bias": {"1" * 11: 1}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"-1": 1}}, "logit_bias"),
]  # fmt: skip


@pytest.mark.parametrize("body, param", BAD_CHAT)
def test_bad_chat_requests_name_the_field(body, param):
    with pytest.raises(InvalidParameterError) as e:
        parse_chat_request(body)
    assert e.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": 5}, "prompt"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
])  # fmt: skip
def test_bad_completion_requests_name_the_field(body, param):
    with pytest.raises(InvalidParameterError) as e:
        parse_completion_request(body)
    assert e.value.param == param


def test_type_errors_read_like_openai():
    with pytest.raises(InvalidParameterError, match=r"^Invalid type for 'max_tokens': expected an integer, "
                                                    r"but got a string instead\.$"):  # fmt: skip
        parse_chat_request({**CHAT, "max_tokens": "5"})
    with pytest.raises(InvalidParameterError, match=r"^Missing required parameter: 'messages'\.$"):
        parse_chat_request({"model": "m"})


# --- bodies -----------------------------------------------------------------------
USAGE = Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=8)
USAGE_BODY = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
              "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip


def head(object_: str, id_: str = "chatcmpl-1") -> dict:
    return {"id": id_, "object": object_, "created": 1700, "model": "m", "system_fingerprint": None}


def test_chat_stream_bodies():
    b = ResponseBodies("chatcmpl-1", "m", is_chat=True, include_usage=True, created=1700)
    chunk = {**head("chat.completion.chunk"), "usage": None}
    assert b.role_chunk() == {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "finish_reason": None, "logprobs": None}]}  # fmt: skip
    assert b.text_chunk("Hi") == {**chunk, "choices": [{"index": 0, "delta": {"content": "Hi"},
                                                        "finish_reason": None, "logprobs": None}]}  # fmt: skip
    assert b.finish_chunk("stop") == {**chunk, "choices": [{"index": 0, "delta": {"content": ""},
                                                            "finish_reason": "stop", "logprobs": None}]}  # fmt: skip
    assert b.finish_chunk("length", "Hi")["choices"][0]["delta"] == {"content": "Hi"}
    assert b.usage_chunk(USAGE) == {**head("chat.completion.chunk"), "choices": [], "usage": USAGE_BODY}


def test_chunks_carry_no_usage_key_unless_asked():
    b = ResponseBodies("chatcmpl-1", "m", is_chat=True, created=1700)
    assert "usage" not in b.text_chunk("x")


def test_chat_completion_body():
    b = ResponseBodies("chatcmpl-1", "m", is_chat=True, created=1700)
    assert b.completion("Hello", "length", USAGE) == {
        **head("chat.completion"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello", "refusal": None},
                     "logprobs": None, "finish_reason": "length"}],
        "usage": USAGE_BODY,
    }  # fmt: skip


def test_text_completion_bodies():
    b = ResponseBodies("cmpl-1", "m", is_chat=False, created=1700)
    assert b.text_chunk("Hi") == {**head("text_completion", "cmpl-1"), "choices": [
        {"index": 0, "text": "Hi", "finish_reason": None, "logprobs": None}]}  # fmt: skip
    assert b.finish_chunk("stop")["choices"] == [{"index": 0, "text": "", "finish_reason": "stop", "logprobs": None}]
    assert b.finish_chunk("length", "Hi")["choices"][0]["text"] == "Hi"
    assert b.completion("Hi", "stop", USAGE) == {
        **head("text_completion", "cmpl-1"),
        "choices": [{"index": 0, "text": "Hi", "logprobs": None, "finish_reason": "stop"}],
        "usage": USAGE_BODY,
    }


def test_sse_framing():
    assert sse.event({"a": "é", "b": None}) == 'data: {"a":"é","b":null}\n\n'.encode()
    assert sse.DONE == b"data: [DONE]\n\n"
