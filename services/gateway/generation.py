"""Turns one request's in-order tokens into text deltas and a finish reason.

Stop strings are found here, with libs.common's StopChecker: workers stop only
on end-of-sequence, stop token ids, max_tokens and the context window. When the
text stops before the workers do, the delta says so and the caller cancels them.
Knows nothing of NATS or HTTP.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from libs.common.model.sampling_params import SamplingParams
from libs.common.model.stopping import StopChecker
from libs.common.model.tokenizer import Tokenizer
from libs.common.schema import TokenChunk


@dataclass(frozen=True)
class Delta:
    text: str  # new text that is safe to show (may be empty)
    finish_reason: str | None = None  # set on the last delta
    stopped_early: bool = False  # finished here while the workers still run: cancel them


class TextStream:
    def __init__(
        self, tokenizer: Tokenizer, sampling: SamplingParams, max_model_len: int, num_prompt_tokens: int
    ) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self._checker = StopChecker(tokenizer, sampling, max_model_len, num_prompt_tokens)
        self._started = False

    @property
    def num_completion_tokens(self) -> int:
        return self._checker.num_tokens

    @property
    def text(self) -> str:
        return self._checker.text

    def feed(self, chunk: TokenChunk) -> Delta:
        """Account for the next in-order chunk; return the text it adds."""
        assert self.finish_reason is None, "chunk fed after the text finished"
        if not self._started:  # the first chunk (from prefill) knows how much of the prompt was cached
            self._started = True
            self.num_cached_tokens = chunk.num_cached_tokens
        pieces = []
        for token_id in chunk.token_ids:
            pieces.append(self._checker.add(token_id))
            if self._checker.finish_reason is not None:
                break
        text = "".join(pieces)
        if self._checker.finish_reason is not None:
            self.finish_reason = self._checker.finish_reason.value
            return Delta(text, self.finish_reason, stopped_early=chunk.finish_reason is None)
        if chunk.finish_reason is not None:  # the worker ended it: release what was held back
            self.finish_reason = chunk.finish_reason
            return Delta(text + self._checker.flush(), self.finish_reason)
        return Delta(text)


class TokenSource(Protocol):
    """Where in-order chunks come from (dispatch.RequestRun, or a fake in tests)."""

    async def next_chunks(self) -> list[TokenChunk]: ...

    async def cancel(self, reason: str) -> None: ...


async def stream_deltas(source: TokenSource, text: TextStream) -> AsyncIterator[Delta]:
    """The request's text deltas, up to and including the one with the finish reason."""
    while True:
        for chunk in await source.next_chunks():
            delta = text.feed(chunk)
            if delta.stopped_early:  # a stop string: the workers would go on to max_tokens
                await source.cancel("stop")
            yield delta
            if delta.finish_reason is not None:
                return
