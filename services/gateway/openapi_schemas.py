"""The component schemas of the gateway's OpenAPI description (`openapi.py`): the
requests, responses, chunks and errors its operations refer to, by name.

Field lists, ranges and the values unsupported features may take come from
`request_limits`, so the description and the parser cannot drift apart.
"""

from typing import Any

from services.gateway.request_limits import (
    IGNORED_FIELDS,
    MAX_LOGIT_BIAS,
    MAX_SCHEMA_BYTES,
    MAX_TOOLS,
    RANGES,
    STREAM_OPTIONS,
    TOOL_CHOICES,
    UNSUPPORTED_UNLESS,
)

Schema = dict[str, Any]

_JSON_TYPE = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object"}


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _integer(field: str) -> Schema:
    valid = RANGES[field]
    return {"type": "integer", "minimum": valid.minimum, "maximum": valid.maximum}


def _number(field: str) -> Schema:
    valid = RANGES[field]
    lower = "exclusiveMinimum" if valid.exclusive_minimum else "minimum"
    schema = {"type": "number", lower: valid.minimum}
    if valid.maximum is not None:
        schema["maximum"] = valid.maximum
    return schema


def _request(endpoint_fields: dict[str, Schema], required: list[str], model_id: str) -> Schema:
    """A request body: the endpoint's fields, the shared ones, and those accepted but ignored or off."""
    properties: dict[str, Schema] = {
        "model": {"enum": [model_id], "description": "The served model's id (any other is a 404)."},
        **endpoint_fields,
        "max_tokens": _nullable(_integer("max_tokens")),
        "temperature": _nullable(_number("temperature")),
        "top_p": _nullable(_number("top_p")),
        "top_k": _nullable({**_integer("top_k"), "description": "vLLM's extension; -1 and 0 mean no top-k cut."}),
        "seed": _nullable(_integer("seed")),
        "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        "stop_token_ids": _nullable({"type": "array", "items": _integer("stop_token_ids")}),
        "ignore_eos": {"type": ["boolean", "null"]},
        "min_p": _nullable({**_number("min_p"), "description": "vLLM's extension: drop tokens less likely than "
                            "min_p times the likeliest, at the request's temperature."}),
        "min_tokens": _nullable({**_integer("min_tokens"), "description": "vLLM's extension: end-of-sequence and "
                                 "stop tokens (and stop strings) end nothing before this many tokens; at most "
                                 "max_tokens."}),
        "presence_penalty": _nullable({**_number("presence_penalty"), "description": "Subtracted once from the "
                                       "logit of every token generated so far."}),
        "frequency_penalty": _nullable({**_number("frequency_penalty"), "description": "Subtracted from a "
                                        "token's logit once per time it was generated so far."}),
        "repetition_penalty": _nullable({**_number("repetition_penalty"), "description": "vLLM's extension: a "
                                         "token seen in the prompt or generated has a positive logit divided by "
                                         "it, a negative one multiplied by it."}),
        "logit_bias": _nullable({
            "type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": _number("logit_bias"),
            "description": "Token id (of the model's vocabulary) -> bias added to its logit before sampling.",
        }),
        "n": _nullable({**_integer("n"), "description": "Choices to generate: the prompt is prefilled once and "
                        "its KV blocks shared by them; usage counts the prompt once."}),
        "stream": {"type": ["boolean", "null"]},
        "stream_options": _nullable({
            "type": "object",
            "properties": {name: {"type": ["boolean", "null"]} for name in STREAM_OPTIONS},
            "additionalProperties": False,
            "description": "Only with stream: true. include_obfuscation is accepted and ignored.",
        }),  # fmt: skip
        "cache_salt": _nullable({
            "type": "string", "minLength": 1,
            "description": "vLLM's: prefix cache reuse only among this tenant's requests with the same salt.",
        }),  # fmt: skip
        "response_format": _nullable(ref("ResponseFormat")),
    }
    for name, kind in IGNORED_FIELDS.items():
        properties[name] = {"type": [_JSON_TYPE[kind], "null"], "description": "Accepted and ignored."}
    for name, allowed in UNSUPPORTED_UNLESS.items():
        properties[name] = {"enum": [None, *allowed], "description": "Not supported: accepted only as shown."}
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": False}


def schemas(model_id: str) -> dict[str, Schema]:
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}, {"type": "null"}]},
            "name": {"type": "string"},
            "tool_calls": {"type": "array", "items": ref("ToolCall"), "description": "assistant: its earlier calls"},
            "tool_call_id": {"type": "string", "description": "tool (required there): the call it answers"},
        },
    }
    name = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
    json_schema = {"type": "object", "description": f"A JSON Schema, at most {MAX_SCHEMA_BYTES} bytes as JSON."}
    response_format = {
        "description": "Constrained decoding: json_object gives a JSON object, json_schema JSON valid under the "
                       "schema (strict: no property it does not name). A schema the grammar engine (xgrammar) "
                       "cannot compile is a 400 naming the problem.",
        "anyOf": [
            {"type": "object", "required": ["type"], "additionalProperties": False,
             "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
             "properties": {"type": {"const": "json_schema"}, "json_schema": {
                 "type": "object", "required": ["name"], "additionalProperties": False,
                 "properties": {"name": name, "description": {"type": "string"}, "schema": json_schema,
                                "strict": {"type": ["boolean", "null"]}}}}},
        ],
    }  # fmt: skip
    tool = {
        "type": "object", "required": ["type", "function"], "additionalProperties": False,
        "properties": {"type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"name": name, "description": {"type": ["string", "null"]},
                           "parameters": _nullable(json_schema), "strict": {"type": ["boolean", "null"]}}}},
    }  # fmt: skip
    tool_call = {
        "type": "object", "required": ["function"],
        "properties": {"id": {"type": "string"}, "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}},
    }  # fmt: skip
    named_choice = {
        "type": "object", "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}},
    }  # fmt: skip
    token_ids = {"type": "array", "items": _integer("prompt")}
    prompt = {
        "anyOf": [
            {"type": "string"},
            token_ids,
            {"type": "array", "items": {"anyOf": [{"type": "string"}, token_ids]}, "minItems": 1, "maxItems": 1},
        ],
        "description": "Text or token ids; a batch of exactly one of either.",
    }
    usage = {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": {"type": "integer"},
            "completion_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"},
            "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
        },
    }
    finish_reason = {"type": ["string", "null"]}

    def completion_object(object_: str, choice: Schema) -> Schema:
        return {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices"],
            "properties": {
                "id": {"type": "string"},
                "object": {"const": object_},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "choices": {"type": "array", "items": choice},
                "usage": {"anyOf": [ref("Usage"), {"type": "null"}]},
                "kvserve": ref("ServedBy"),
            },
        }

    token_bytes = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}
    logprob = {"type": "number", "description": "-9999.0 for a token a control masked."}
    top_entry = {
        "type": "object",
        "required": ["token", "logprob", "bytes"],
        "properties": {"token": {"type": "string"}, "logprob": logprob, "bytes": token_bytes},
    }
    chat_logprobs = {
        "type": "object",
        "required": ["content"],
        "properties": {
            "content": {"type": "array", "items": {
                "type": "object",
                "required": ["token", "logprob", "bytes", "top_logprobs"],
                "properties": {**top_entry["properties"], "top_logprobs": {"type": "array", "items": top_entry}},
            }},
            "refusal": {"type": "null"},
        },
    }  # fmt: skip
    completion_logprobs = {
        "type": "object",
        "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {
            "tokens": {"type": "array", "items": {"type": "string"}},
            "token_logprobs": {"type": "array", "items": logprob},
            "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": logprob}},
            "text_offset": {"type": "array", "items": {"type": "integer"}},
        },
    }
    chat_choice = {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "message": {
                "type": "object",
                "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                               "tool_calls": {"type": "array", "items": ref("ToolCall")}},
            },
            "logprobs": {"anyOf": [ref("ChatLogprobs"), {"type": "null"}]},
            "finish_reason": finish_reason,
        },
    }
    text_choice = {
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                       "logprobs": {"anyOf": [ref("CompletionLogprobs"), {"type": "null"}]},
                       "finish_reason": finish_reason},
    }  # fmt: skip
    model_card = {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {"type": "integer", "description": "vLLM's extension: the context window."},
        },
    }
    return {
        "ChatCompletionRequest": _request(
            {
                "messages": {"type": "array", "items": message, "minItems": 1},
                "max_completion_tokens": _nullable(_integer("max_completion_tokens")),
                "logprobs": {"type": ["boolean", "null"], "description": "Return each generated token's logprob "
                             "(read after logit bias, min_tokens and penalties, before temperature, top-k, top-p "
                             "and min-p)."},
                "top_logprobs": _nullable({**_integer("top_logprobs"), "description": "With logprobs: true, "
                                           "also this many likeliest tokens per position."}),
                "tools": _nullable({"type": "array", "items": ref("Tool"), "maxItems": MAX_TOOLS,
                                    "description": "Function tools: rendered by the chat template if it takes "
                                    "tools, else in the system message in kvserve's default format (README)."}),
                "tool_choice": _nullable({"anyOf": [{"enum": list(TOOL_CHOICES)}, named_choice],
                                          "description": "Only with tools. required or a named function: the "
                                          "answer is one call, its arguments constrained to the function's "
                                          "parameters."}),
                "parallel_tool_calls": {"type": ["boolean", "null"], "description": "false: at most one call "
                                        "per answer (a forced call is always one)."},
            },
            ["model", "messages"],
            model_id,
        ),
        "CompletionRequest": _request(
            {
                "prompt": prompt,
                "logprobs": _nullable({**_integer("logprobs"), "description": "Return each generated token's "
                                       "logprob and this many likeliest tokens per position (vLLM's maximum, "
                                       "20; read as for chat)."}),
            },
            ["model", "prompt"],
            model_id,
        ),
        "ResponseFormat": response_format,
        "Tool": tool,
        "ToolCall": tool_call,
        "ChatLogprobs": chat_logprobs,
        "CompletionLogprobs": completion_logprobs,
        "ChatCompletion": completion_object("chat.completion", chat_choice),
        "Completion": completion_object("text_completion", text_choice),
        "Usage": usage,
        "ServedBy": {
            "type": "object",
            "description": "kvserve's extension, on a non-streaming body and on the chunk with the finish reason: "
            "the instances that served the request, in order, and how often it moved to another worker "
            "because one died (the x-kvserve-*-instance headers name only the first).",
            "required": ["prefill_instances", "decode_instances", "migrations"],
            "properties": {
                "prefill_instances": {"type": "array", "items": {"type": "string"}},
                "decode_instances": {"type": "array", "items": {"type": "string"}},
                "migrations": {"type": "integer", "minimum": 0},
            },
        },
        "Model": model_card,
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}},
        },
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "param", "code"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"], "description": "The request field at fault."},
                        "code": {"type": ["string", "null"]},
                    },
                },
            },
        },
        "Health": {
            "type": "object",
            "required": ["status", "instance_id", "model", "in_flight", "uptime_s"],
            "properties": {
                "status": {"enum": ["ok", "unavailable"]},
                "reasons": {"type": "array", "items": {"type": "string"}, "description": "Why it is not ready."},
                "instance_id": {"type": "string"},
                "model": {"type": "string"},
                "in_flight": {"type": "integer"},
                "uptime_s": {"type": "number"},
            },
        },
    }


def usage_schema() -> Schema:
    count = {"type": "integer", "minimum": 0}
    return {
        "type": "object",
        "required": ["object", "tenant", "since", "requests", "prompt_tokens", "cached_tokens", "completion_tokens",
                     "refusals", "in_flight", "limits"],
        "properties": {
            "object": {"const": "usage"},
            "tenant": {"type": "string"},
            "since": {"type": "integer", "description": "When this gateway started counting (Unix time)."},
            "requests": count, "prompt_tokens": count, "cached_tokens": count, "completion_tokens": count,
            "refusals": {"type": "object", "additionalProperties": count, "description": "429s by reason."},
            "in_flight": count,
            "limits": {"type": "object", "additionalProperties": {"type": "integer"},
                       "description": "The tenant's quotas, as in the tenants file."},
        },
    }  # fmt: skip
