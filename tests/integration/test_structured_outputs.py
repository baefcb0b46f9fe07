"""Structured outputs and tools through the whole cluster with the official client and
the default model: `beta.chat.completions.parse` over twenty Pydantic models, JSON
mode, a schema the grammar engine refuses, and a tool-calling loop (a forced call,
its result sent back, a final answer), streamed and not."""

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from pydantic import BaseModel, Field

from tests.integration.structured_schemas import MODELS

MODEL = "SmolLM2-135M-Instruct"


class WeatherArgs(BaseModel, extra="forbid"):
    city: str = Field(max_length=24)
    unit: str


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_parse_returns_a_valid_object_for_every_model(openai_client):
    def parse(item):
        model, question = item
        return openai_client.beta.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": question}], response_format=model,
            max_tokens=160, temperature=0,
        )  # fmt: skip

    with ThreadPoolExecutor(len(MODELS)) as pool:  # one batch on the decode worker
        answers = list(pool.map(parse, MODELS))
    for (model, _), answer in zip(MODELS, answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", model.__name__
        assert isinstance(choice.message.parsed, model), model.__name__
        assert model.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("stream", [False, True])
def test_json_mode_always_gives_a_json_object(openai_client, stream):
    # questions the default model answers with an object it closes: free-form JSON from a
    # 135M model can also loop until max_tokens (finish_reason "length", a valid JSON prefix)
    questions = ["Give me three colours.", "Hello!"]

    def ask(question):
        request = dict(model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=200, temperature=0,
                       response_format={"type": "json_object"})  # fmt: skip
        if not stream:
            choice = openai_client.chat.completions.create(**request).choices[0]
            return choice.message.content, choice.finish_reason
        chunks = list(openai_client.chat.completions.create(**request, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)

    with ThreadPoolExecutor(len(questions)) as pool:
        for text, finish_reason in pool.map(ask, questions):
            assert finish_reason == "stop"
            assert isinstance(json.loads(text), dict)


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_the_problem(openai_client):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, response_format=bad)
    assert e.value.status_code == 400
    assert 'Unsupported type "objectx"' in e.value.body["message"]


def _follow_up(call) -> list[dict]:
    """The history after ``call``: the assistant's call and the tool's answer."""
    return [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21, "sky": "sunny"}'}]  # fmt: skip


def test_a_tool_calling_loop_completes(openai_client):
    first = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL],
                                                  tool_choice="required", max_tokens=60, temperature=0)  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = WeatherArgs.model_validate_json(call.function.arguments)
    assert args.unit in ("celsius", "fahrenheit")
    final = openai_client.chat.completions.create(model=MODEL, messages=_follow_up(call), tools=[WEATHER_TOOL],
                                                  max_tokens=40, temperature=0)  # fmt: skip
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert answer.message.content


def test_a_streamed_tool_calling_loop_completes(openai_client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    with openai_client.beta.chat.completions.stream(model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL],
                                                    tool_choice=named, max_tokens=60, temperature=0) as stream:  # fmt: skip
        first = stream.get_final_completion()  # the client reassembles delta.tool_calls
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    WeatherArgs.model_validate_json(call.function.arguments)
    stream = openai_client.chat.completions.create(model=MODEL, messages=_follow_up(call), tools=[WEATHER_TOOL],
                                                   max_tokens=40, temperature=0, stream=True)  # fmt: skip
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
