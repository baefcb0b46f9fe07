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

    def _chunk(self, choice: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        body["choices"] = [{"index": 0, **choice, "logprobs": logprobs}]
        if self.include_usage:  # OpenAI: every chunk has "usage": null, the last one the numbers
            body["usage"] = None
        return body

    def role_chunk(self) -> dict[str, Any]:
        """The chat stream's first chunk: the assistant's role, no text yet."""
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def text_chunk(self, text: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Text (and, when asked for, the ``logprobs`` of the tokens it came with)."""
        if self.is_chat:
            return self._chunk({"delta": {"content": text}, "finish_reason": None}, logprobs)
        return self._chunk({"text": text, "finish_reason": None}, logprobs)

    def finish_chunk(
        self, finish_reason: str, text: str = "", logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The chunk that ends the answer: its last text, "" when the last tokens have
        none (an end-of-sequence token under ignore_eos), with the finish reason, as
        vLLM sends it; so every answer whose usage counts tokens has a content chunk."""
        if self.is_chat:
            return self._chunk({"delta": {"content": text}, "finish_reason": finish_reason}, logprobs)
        return self._chunk({"text": text, "finish_reason": finish_reason}, logprobs)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage.body()
        return body

    def completion(self, text: str, finish_reason: str, usage: Usage,
                   logprobs: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        """The whole answer of a request that did not stream."""
        if self.is_chat:
            body = self._head("chat.completion")
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            body = self._head("text_completion")
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
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
