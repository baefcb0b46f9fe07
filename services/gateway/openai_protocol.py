"""The OpenAI wire format, requests: a decoded request body
(`request_limits.decode_body`) becomes a `GenerateRequest`, or InvalidParameterError
naming the offending field, within the limits `request_limits` sets; it knows
nothing of the model or the cluster. The bodies sent back are `response_bodies.py`'s.
A JSON Schema is checked for shape here; whether the grammar engine can compile it
is the worker's to say (a 400 all the same).
"""

import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from libs.protocol.sampling_params import Grammar
from services.gateway.errors import InvalidParameterError
from services.gateway.json_fields import (
    bool_field,
    check_items,
    fields_of,
    float_field,
    int_field,
    int_list,
    is_int,
    refuse_unknown,
    required,
    show,
    type_error,
)
from services.gateway.request_limits import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_LOGIT_BIAS,
    MAX_SCHEMA_BYTES,
    MAX_TOOLS,
    RANGES,
    STREAM_OPTIONS,
    TOOL_CHOICES,
)
from services.gateway.tools import ToolUse

Messages = list[dict[str, Any]]
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's function and json_schema names

_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class GenerateRequest:
    """One chat or text completion request, checked for types and shape only."""

    model: str
    n: int = 1  # sequences to generate, each a choice of the answer
    messages: Messages | None = None  # chat
    prompt: str | list[int] | None = None  # completions: text or token ids
    max_tokens: int | None = None  # None: the endpoint's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias
    logprobs: int | None = None  # None: no logprobs; n: the sampled token's and the n likeliest
    grammar: Grammar | None = None  # response_format json_object or json_schema
    tools: tuple[dict[str, Any], ...] = ()  # function tools, rendered into the prompt
    tool_use: ToolUse | None = None  # what the tools ask of the answer (None: no tools, or tool_choice "none")
    stream: bool = False
    include_usage: bool = False
    user: str | None = None  # OpenAI's end-user id: kvserve keeps a user's turns near their KV (session affinity)
    cache_salt: str | None = None  # vLLM's: prefix reuse only among requests with the same salt (within a tenant)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def parse_chat_request(body: Any) -> GenerateRequest:
    body = fields_of(body, CHAT_FIELDS)
    messages = _messages(required(body, "messages"))
    max_tokens = int_field(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens")
    # OpenAI's chat logprobs: a switch, and how many alternatives (which need the switch on)
    top_logprobs = int_field(body, "top_logprobs")
    logprobs = None
    if bool_field(body, "logprobs"):
        logprobs = top_logprobs or 0
    elif top_logprobs:
        raise InvalidParameterError("Invalid 'top_logprobs': 'logprobs' must be true to use it.", "top_logprobs")
    tools, tool_use = _tools(body)
    common = _common(body)
    if tool_use is not None and tool_use.is_forced:
        if common["grammar"] is not None:
            message = "'response_format' cannot be combined with a 'tool_choice' that forces a call"
            raise InvalidParameterError(message, "response_format")
        common["grammar"] = tool_use.grammar()
    return GenerateRequest(messages=messages, max_tokens=max_tokens, logprobs=logprobs, tools=tools,
                           tool_use=tool_use, **common)  # fmt: skip


def parse_completion_request(body: Any) -> GenerateRequest:
    body = fields_of(body, COMPLETION_FIELDS)
    prompt = _prompt(required(body, "prompt"))
    logprobs = int_field(body, "logprobs")  # the completions API's: how many alternatives per token
    return GenerateRequest(prompt=prompt, max_tokens=int_field(body, "max_tokens"), logprobs=logprobs, **_common(body))


def _common(body: dict[str, Any]) -> dict[str, Any]:
    """The fields both endpoints share."""
    model = required(body, "model")
    if not isinstance(model, str):
        raise type_error("model", "a string", model)
    n = int_field(body, "n")
    stream = bool(bool_field(body, "stream"))
    include_usage = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise InvalidParameterError("'stream_options' is only allowed when 'stream' is enabled", "stream_options")
        if not isinstance(stream_options, dict):
            raise type_error("stream_options", "an object", stream_options)
        for name in STREAM_OPTIONS:
            bool_field(stream_options, name, f"stream_options.{name}")
        refuse_unknown(stream_options, STREAM_OPTIONS, "stream_options.")
        include_usage = bool(stream_options.get("include_usage"))
    top_k = int_field(body, "top_k")
    temperature, top_p = float_field(body, "temperature"), float_field(body, "top_p")
    repetition_penalty = float_field(body, "repetition_penalty")
    return dict(
        model=model,
        n=1 if n is None else n,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=None if top_k in (None, 0, -1) else top_k,  # vLLM: 0 and -1 mean "no top-k cut"
        min_p=float_field(body, "min_p") or 0.0,
        seed=int_field(body, "seed"),
        stop=_stop(body.get("stop")),
        stop_token_ids=tuple(int_list(body, "stop_token_ids")),
        ignore_eos=bool(bool_field(body, "ignore_eos")),
        min_tokens=int_field(body, "min_tokens") or 0,
        presence_penalty=float_field(body, "presence_penalty") or 0.0,
        frequency_penalty=float_field(body, "frequency_penalty") or 0.0,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        logit_bias=_logit_bias(body.get("logit_bias")),
        grammar=_response_format(body.get("response_format")),
        stream=stream,
        include_usage=include_usage,
        user=body.get("user") or None,  # type-checked with the ignored fields
        cache_salt=_cache_salt(body.get("cache_salt")),
    )


def _cache_salt(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidParameterError("Invalid 'cache_salt': expected a non-empty string", "cache_salt")
    return value


def _messages(value: Any) -> Messages:
    if not isinstance(value, list):
        raise type_error("messages", "an array", value)
    if not value:
        raise InvalidParameterError("'messages' must contain at least one message", "messages")
    messages = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise type_error(param, "an object", message)
        role = message.get("role")
        if role not in _ROLES:
            raise InvalidParameterError(
                f"Invalid '{param}.role': expected one of {', '.join(_ROLES)}, got {role!r}", f"{param}.role"
            )
        out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), f"{param}.content")}
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        if role == "assistant" and message.get("tool_calls") is not None:
            out["tool_calls"] = _tool_calls(message["tool_calls"], f"{param}.tool_calls")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise type_error(f"{param}.tool_call_id", "a string", call_id)
            out["tool_call_id"] = call_id
        messages.append(out)
    return messages


def _tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls: [{id, type: "function", function: {name, arguments}}]."""
    if not isinstance(value, list):
        raise type_error(param, "an array", value)
    calls = []
    for i, call in enumerate(value):
        where = f"{param}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise type_error(where, "a function tool call", call)
        name, arguments = function.get("name"), function.get("arguments", "")
        if not isinstance(name, str):
            raise type_error(f"{where}.function.name", "a string", name)
        if not isinstance(arguments, str):
            raise type_error(f"{where}.function.arguments", "a string", arguments)
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise type_error(f"{where}.id", "a string", call_id)
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def _response_format(value: Any) -> Grammar | None:
    """OpenAI's response_format: text (no grammar), json_object, or json_schema."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise type_error("response_format", "an object", value)
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        message = f"Invalid 'response_format.type': expected one of text, json_object, json_schema, got {show(kind)}"
        raise InvalidParameterError(message, "response_format.type")
    refuse_unknown(value, ("type", "json_schema") if kind == "json_schema" else ("type",), "response_format.")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar(kind="json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise type_error("response_format.json_schema", "an object", spec)
    refuse_unknown(spec, ("name", "description", "schema", "strict"), "response_format.json_schema.")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        message = "Invalid 'response_format.json_schema.name': expected 1 to 64 of a-z, A-Z, 0-9, _ and -"
        raise InvalidParameterError(message, "response_format.json_schema.name")
    if not isinstance(spec.get("description", ""), str):
        raise type_error("response_format.json_schema.description", "a string", spec["description"])
    strict = bool_field(spec, "strict", "response_format.json_schema.strict")
    schema = spec.get("schema")
    if schema is None:  # OpenAI: no schema, any JSON object
        return Grammar(kind="json_object", strict=bool(strict))
    return Grammar(kind="json_schema", schema=_schema_text(schema, "response_format.json_schema.schema"),
                   strict=bool(strict))  # fmt: skip


def _schema_text(schema: Any, param: str) -> str:
    """A JSON Schema as compact JSON text (its keys in the order sent: properties are generated in it)."""
    if not isinstance(schema, dict):
        raise type_error(param, "an object", schema)
    text = msgspec.json.encode(schema).decode()
    if len(text) > MAX_SCHEMA_BYTES:
        message = f"Invalid '{param}': at most {MAX_SCHEMA_BYTES} bytes of JSON, got {len(text)}."
        raise InvalidParameterError(message, param)
    return text


def _tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], ToolUse | None]:
    """OpenAI's tools (functions only), tool_choice and parallel_tool_calls."""
    value, choice = body.get("tools"), body.get("tool_choice")
    tools: list[dict[str, Any]] = []
    if value is not None:
        if not isinstance(value, list):
            raise type_error("tools", "an array", value)
        if len(value) > MAX_TOOLS:
            raise InvalidParameterError(f"Invalid 'tools': at most {MAX_TOOLS} tools, got {len(value)}.", "tools")
        tools = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(value)]
    names = [t["function"]["name"] for t in tools]
    function = None
    if isinstance(choice, dict):
        named = choice.get("function")
        if choice.get("type") != "function" or not isinstance(named, dict) or not isinstance(named.get("name"), str):
            raise type_error("tool_choice", '{"type": "function", "function": {"name": ...}}', choice)
        function = named["name"]
        if function not in names:
            message = f"Invalid 'tool_choice': no function named {show(function)} is in 'tools'."
            raise InvalidParameterError(message, "tool_choice")
        choice = "function"
    elif choice is not None and choice not in TOOL_CHOICES:
        message = f"Invalid 'tool_choice': expected one of {', '.join(TOOL_CHOICES)} or a named function, got {show(choice)}"
        raise InvalidParameterError(message, "tool_choice")
    if choice is not None and choice != "none" and not tools:
        raise InvalidParameterError("Invalid 'tool_choice': only allowed when 'tools' are specified.", "tool_choice")
    parallel = bool_field(body, "parallel_tool_calls")
    if not tools or choice == "none":
        return tuple(tools), None
    return tuple(tools), ToolUse(tuple(tools), choice or "auto", function, parallel is not False)


def _tool(tool: Any, param: str) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise type_error(param, 'a function tool ({"type": "function", "function": {...}})', tool)
    refuse_unknown(tool, ("type", "function"), f"{param}.")
    refuse_unknown(function, ("name", "description", "parameters", "strict"), f"{param}.function.")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        message = f"Invalid '{param}.function.name': expected 1 to 64 of a-z, A-Z, 0-9, _ and -"
        raise InvalidParameterError(message, f"{param}.function.name")
    out: dict[str, Any] = {"name": name}
    if function.get("description") is not None:
        if not isinstance(function["description"], str):
            raise type_error(f"{param}.function.description", "a string", function["description"])
        out["description"] = function["description"]
    if function.get("parameters") is not None:
        _schema_text(function["parameters"], f"{param}.function.parameters")
        out["parameters"] = function["parameters"]
    bool_field(function, "strict", f"{param}.function.strict")
    return {"type": "function", "function": out}


def _content(content: Any, param: str) -> str:
    """A message's text: a string, null, or a list of text parts (joined by newlines, as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise type_error(param, "a string or an array of content parts", content)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            message = f"Invalid '{param}[{j}]': only text content parts are supported, got {kind!r}"
            raise InvalidParameterError(message, f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompt(value: Any) -> str | list[int]:
    """A string, a list of token ids, or a one-element batch of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(is_int(v) for v in value):
        check_items("prompt", value)
        return list(value)
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise InvalidParameterError("batched prompts are not supported: send one prompt per request", "prompt")
    raise type_error("prompt", "a string or an array of token ids", value)


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as the object's keys) to a bias in [-100, 100]; whether
    each id is in the model's vocabulary is the served model's to say."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise type_error("logit_bias", "an object", value)
    if len(value) > MAX_LOGIT_BIAS:
        message = f"Invalid 'logit_bias': at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(value)}."
        raise InvalidParameterError(message, "logit_bias")
    biases = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) not in RANGES["prompt"]:
            raise InvalidParameterError(f"Invalid 'logit_bias': {show(key)} is not a token id.", "logit_bias")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool):
            raise type_error(f"logit_bias.{key}", "a number", bias)
        if bias not in RANGES["logit_bias"]:
            message = f"Invalid 'logit_bias.{key}': expected a number in {RANGES['logit_bias']}, but got {show(bias)}."
            raise InvalidParameterError(message, f"logit_bias.{key}")
        biases[int(key)] = float(bias)
    return biases


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise type_error("stop", "a string or an array of strings", value)


# --- field readers: a missing field and an explicit null both read as None --------
