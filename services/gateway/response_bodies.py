"""The OpenAI wire format, responses: the exact JSON OpenAI sends for a chat or text
completion, whole or as stream chunks, its usage, and the model list."""

import time
from dataclasses import dataclass
from typing import Any


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

    def _chunk(
        self, choice: dict[str, Any], logprobs: dict[str, Any] | None = None, index: int = 0
    ) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        body["choices"] = [{"index": index, **choice, "logprobs": logprobs}]
        if self.include_usage:  # OpenAI: every chunk has "usage": null, the last one the numbers
            body["usage"] = None
        return body

    def role_chunk(self, index: int = 0) -> dict[str, Any]:
        """The chat stream's first chunk of a choice: the assistant's role, no text yet."""
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None}, index=index)

    def text_chunk(self, text: str, logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
        """Text of choice ``index`` (and, when asked for, the ``logprobs`` of the tokens it came with)."""
        if self.is_chat:
            return self._chunk({"delta": {"content": text}, "finish_reason": None}, logprobs, index)
        return self._chunk({"text": text, "finish_reason": None}, logprobs, index)

    def tool_calls_chunk(self, calls: list[dict[str, Any]], index: int = 0) -> dict[str, Any]:
        """A chat stream's calls of choice ``index``, each whole (``calls``: delta.tool_calls entries)."""
        return self._chunk({"delta": {"tool_calls": calls}, "finish_reason": None}, index=index)

    def finish_chunk(
        self, finish_reason: str, text: str = "", logprobs: dict[str, Any] | None = None, index: int = 0
    ) -> dict[str, Any]:
        """The chunk that ends a choice: its last text, "" when the last tokens have
        none (an end-of-sequence token under ignore_eos), with the finish reason, as
        vLLM sends it; so every answer whose usage counts tokens has a content chunk."""
        if self.is_chat:
            delta = {} if finish_reason == "tool_calls" and not text else {"content": text}
            return self._chunk({"delta": delta, "finish_reason": finish_reason}, logprobs, index)
        return self._chunk({"text": text, "finish_reason": finish_reason}, logprobs, index)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage.body()
        return body

    def completion(self, text: str, finish_reason: str, usage: Usage,
                   logprobs: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        """The whole answer of a request that did not stream (one choice)."""
        return self.completion_of([Choice(text, finish_reason, logprobs)], usage)

    def completion_of(self, choices: list["Choice"], usage: Usage) -> dict[str, Any]:
        """The whole answer of a request that did not stream, its choices in index order."""
        body = self._head("chat.completion" if self.is_chat else "text_completion")
        body["choices"] = []
        for index, c in enumerate(choices):
            if self.is_chat:
                message = {"role": "assistant", "content": c.text, "refusal": None}
                if c.tool_calls:
                    message["content"] = c.text or None
                    message["tool_calls"] = c.tool_calls
                body["choices"].append({"index": index, "message": message, "logprobs": c.logprobs,
                                        "finish_reason": c.finish_reason})  # fmt: skip
            else:
                body["choices"].append({"index": index, "text": c.text, "logprobs": c.logprobs,
                                        "finish_reason": c.finish_reason})  # fmt: skip
        body["usage"] = usage.body()
        return body


@dataclass(frozen=True)
class Choice:
    """One whole choice of an answer."""

    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # chat: the calls parsed out of the text


def model_card(model_id: str, created: int, max_model_len: int) -> dict[str, Any]:
    """One entry of GET /v1/models (``max_model_len`` is vLLM's extension)."""
    return {
        "id": model_id, "object": "model", "created": created, "owned_by": "kvserve", "max_model_len": max_model_len
    }


def model_list(model_id: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model_id, created, max_model_len)]}
