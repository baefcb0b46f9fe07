"""Tool calling: a request's tools into the prompt, and the model's calls out of its text.

A model whose chat template takes ``tools`` gets them there; any other gets them in
its system message in the default format below (Hermes' and Qwen's): the tools as
JSON lines inside <tools></tools>, each call the model makes as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Earlier calls in the
history (assistant messages with ``tool_calls``) are written back in that format,
and ``tool`` messages keep their role. With ``tool_choice`` "required" or a named
function the whole answer is constrained to one call, ``{"name": ..., "arguments":
...}`` with the arguments valid under the function's JSON Schema (a grammar built
from it), so even a small model answers with a call that validates.
"""

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from libs.protocol.sampling_params import Grammar

DEFAULT_FORMAT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def body(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI tool_calls entry (with ``index``: a stream's delta.tool_calls entry)."""
        body = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools ask of its answer: ``tools`` are OpenAI's function tools
    as sent; ``choice`` is "auto", "required" or "function" (then ``function`` names
    it); tool_choice "none" keeps no ToolUse at all, only the tools in the prompt."""

    tools: tuple[dict[str, Any], ...]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "function")

    def grammar(self) -> Grammar | None:
        """The grammar a forced call is generated under: one call of the named function,
        or of any of the tools, its arguments valid under the function's parameters."""
        if not self.is_forced:
            return None
        calls = [_call_schema(t["function"]) for t in self.tools
                 if self.function is None or t["function"]["name"] == self.function]  # fmt: skip
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return Grammar(kind="json_schema", schema=json.dumps(schema), strict=True)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The answer's text without its calls, and its calls (the first only, unless parallel)."""
        if self.is_forced:
            call = _call(text)
            return ("", [call]) if call is not None else (text, [])
        calls = [c for c in (_call(m.group(1)) for m in _CALL.finditer(text)) if c is not None]
        if not calls:
            return text, []
        content = text[: text.index("<tool_call>")].strip()
        return content, calls if self.parallel else calls[:1]


def render_messages(messages: list[dict[str, Any]], tools: tuple[dict[str, Any], ...],
                    template_takes_tools: bool) -> list[dict[str, Any]]:  # fmt: skip
    """``messages`` for a chat template: as they are for one that takes tools (with the
    calls' arguments as objects, as Hugging Face templates expect them), else with the
    tools in the system message in the default format and each earlier call as text."""
    if template_takes_tools:
        return [_structured(m) for m in messages]
    out = [_as_text(m) for m in messages]
    if tools:
        listing = DEFAULT_FORMAT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0]['content']}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_call_id"}
    written = [f'<tool_call>\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
               f'{c["function"]["arguments"] or "{}"}}}\n</tool_call>' for c in calls]  # fmt: skip
    text = "\n".join(filter(None, [message.get("content") or "", *written]))
    return {"role": message["role"], "content": text}


def _structured(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for c in calls:
        arguments = c["function"]["arguments"]
        try:
            arguments = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError:
            pass  # a template shows it as the text it is
        parsed.append({**c, "function": {**c["function"], "arguments": arguments}})
    return {**message, "tool_calls": parsed}


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": function.get("parameters") or _ANY_OBJECT},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _call(text: str) -> ToolCall | None:
    """A call written as {"name": ..., "arguments": ...}; None for anything else."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], arguments, f"call_{uuid.uuid4().hex[:24]}")
