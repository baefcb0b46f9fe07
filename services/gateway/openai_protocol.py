"""The OpenAI wire format: request bodies in, response and chunk bodies out.

Parsing turns a decoded JSON body into a `GenerateRequest` or raises
InvalidParameterError naming the offending field; it knows nothing of the model
or the cluster. The builders make the exact JSON OpenAI sends.
"""

import time
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import InvalidParameterError

Messages = list[dict[str, str]]

# Fields kvserve does not implement: a value other than these is refused rather
# than silently ignored, so a client never gets an answer it did not ask for.
_UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class GenerateRequest:
    """One chat or text completion request, checked for types and shape only."""

    model: str
    messages: Messages | None = None  # chat
    prompt: str | list[int] | None = None  # completions: text or token ids
    max_tokens: int | None = None  # None: the endpoint's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def parse_chat_request(body: Any) -> GenerateRequest:
    body = _object(body)
    messages = _messages(_required(body, "messages"))
    max_tokens = _int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", minimum=1)
    return GenerateRequest(messages=messages, max_tokens=max_tokens, **_common(body))


def parse_completion_request(body: Any) -> GenerateRequest:
    body = _object(body)
    prompt = _prompt(_required(body, "prompt"))
    return GenerateRequest(prompt=prompt, max_tokens=_int(body, "max_tokens", minimum=1), **_common(body))


def _common(body: dict[str, Any]) -> dict[str, Any]:
    """The fields both endpoints share."""
    model = _required(body, "model")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    for name, allowed in _UNSUPPORTED_UNLESS.items():
        if body.get(name) not in allowed:
            raise InvalidParameterError(f"'{name}' is not supported by this server", name)
    n = _int(body, "n")
    if n is not None and n != 1:
        raise InvalidParameterError(f"Invalid 'n': only n=1 is supported, got {n}", "n")
    stream = bool(_bool(body, "stream"))
    include_usage = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise InvalidParameterError("'stream_options' is only allowed when 'stream' is enabled", "stream_options")
        if not isinstance(stream_options, dict):
            raise _type_error("stream_options", "an object", stream_options)
        include_usage = bool(_bool(stream_options, "include_usage", "stream_options.include_usage"))
    top_k = _int(body, "top_k")
    temperature, top_p = _float(body, "temperature"), _float(body, "top_p")
    return dict(
        model=model,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=None if top_k in (None, 0, -1) else top_k,  # vLLM: 0 and -1 mean "no top-k cut"
        seed=_int(body, "seed"),
        stop=_stop(body.get("stop")),
        stop_token_ids=tuple(_int_list(body, "stop_token_ids")),
        ignore_eos=bool(_bool(body, "ignore_eos")),
        stream=stream,
        include_usage=include_usage,
    )


def _messages(value: Any) -> Messages:
    if not isinstance(value, list):
        raise _type_error("messages", "an array", value)
    if not value:
        raise InvalidParameterError("'messages' must contain at least one message", "messages")
    messages = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _type_error(param, "an object", message)
        role = message.get("role")
        if role not in _ROLES:
            raise InvalidParameterError(
                f"Invalid '{param}.role': expected one of {', '.join(_ROLES)}, got {role!r}", f"{param}.role"
            )
        out = {"role": role, "content": _content(message.get("content"), f"{param}.content")}
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        messages.append(out)
    return messages


def _content(content: Any, param: str) -> str:
    """A message's text: a string, null, or a list of text parts (joined by newlines, as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _type_error(param, "a string or an array of content parts", content)
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
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise InvalidParameterError("batched prompts are not supported: send one prompt per request", "prompt")
    raise _type_error("prompt", "a string or an array of token ids", value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _type_error("stop", "a string or an array of strings", value)


# --- field readers: a missing field and an explicit null both read as None --------
def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidParameterError("the request body must be a JSON object")
    return body


def _required(body: dict[str, Any], name: str) -> Any:
    if body.get(name) is None:
        raise InvalidParameterError(f"Missing required parameter: '{name}'.", name)
    return body[name]


def _int(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _type_error(name, "an integer", value)
    if minimum is not None and value < minimum:
        message = f"Invalid '{name}': integer below minimum value. Expected a value >= {minimum}, but got {value}."
        raise InvalidParameterError(message, name)
    return value


def _float(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _type_error(name, "a number", value)
    return float(value)


def _bool(body: dict[str, Any], name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _type_error(param or name, "a boolean", value)
    return value


def _int_list(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _type_error(name, "an array of integers", value)
    return value


_JSON_TYPES = {
    str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array", dict: "an object"
}


def _type_error(param: str, expected: str, value: Any) -> InvalidParameterError:
    got = "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)
    return InvalidParameterError(f"Invalid type for '{param}': expected {expected}, but got {got} instead.", param)


# --- response bodies -----------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class ResponseBodies:
    """Every body one request's response is made of, chat or text completion."""

    def __init__(self, response_id: str, model: str, is_chat: bool, include_usage: bool = False,
                 created: int | None = None) -> None:  # fmt: skip
        self.id = response_id
        self.model = model
        self.is_chat = is_chat
        self.include_usage = include_usage
        self.created = int(time.time()) if created is None else created

    def _head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model,
                "system_fingerprint": None}  # fmt: skip

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        body["choices"] = [{"index": 0, **choice, "logprobs": None}]
        if self.include_usage:  # OpenAI: every chunk has "usage": null, the last one the numbers
            body["usage"] = None
        return body

    def role_chunk(self) -> dict[str, Any]:
        """The chat stream's first chunk: the assistant's role, no text yet."""
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def text_chunk(self, text: str) -> dict[str, Any]:
        if self.is_chat:
            return self._chunk({"delta": {"content": text}, "finish_reason": None})
        return self._chunk({"text": text, "finish_reason": None})

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        if self.is_chat:
            return self._chunk({"delta": {}, "finish_reason": finish_reason})
        return self._chunk({"text": "", "finish_reason": finish_reason})

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage.body()
        return body

    def completion(self, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
        """The whole answer of a request that did not stream."""
        if self.is_chat:
            body = self._head("chat.completion")
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body["choices"] = [choice]
        body["usage"] = usage.body()
        return body


def model_card(model_id: str, created: int, max_model_len: int) -> dict[str, Any]:
    """One entry of GET /v1/models (``max_model_len`` is vLLM's extension)."""
    return {
        "id": model_id, "object": "model", "created": created, "owned_by": "kvserve", "max_model_len": max_model_len
    }


def model_list(model_id: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model_id, created, max_model_len)]}
