"""Turns one request's in-order tokens into text deltas and a finish reason.

Stop strings are found here, with the engine's StopChecker, which applies the workers'
token rules first (`stopping.token_finish`: end-of-sequence, stop token ids, max_tokens,
the context window). When the text stops before the workers do, the delta says so and
the caller cancels them.
Knows nothing of NATS or HTTP.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from libs.engine.model.stopping import StopChecker
from libs.engine.model.tokenizer import Tokenizer
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.schema import TokenChunk, TokenLogprobs


@dataclass(frozen=True)
class Delta:
    text: str  # new text that is safe to show (may be empty)
    finish_reason: str | None = None  # set on the last delta
    stopped_early: bool = False  # finished here while the workers still run: cancel them
    token_ids: list[int] = field(default_factory=list)  # the tokens it accounts for (each counted in usage)
    logprobs: list[TokenLogprobs] | None = None  # theirs, when the request asked for them
    choice: int = 0  # which of the request's sequences it is the text of


class TextStream:
    """The text of one request's generated tokens, released as it becomes safe to show.

    Every finish (the workers', a stop here, a failure) releases all the text the
    counted tokens make: what was held back for a stop string and the bytes of an
    unfinished UTF-8 character, shown as a whole decode of the tokens shows them;
    a stop string cuts the text before it.
    """

    def __init__(
        self, tokenizer: Tokenizer, sampling: SamplingParams, max_model_len: int, num_prompt_tokens: int
    ) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self._stops = list(sampling.stop)
        self._checker = StopChecker(tokenizer, sampling, max_model_len, num_prompt_tokens)
        self._cut_by_stop_string = False
        self._final_text: str | None = None  # once finished
        self._num_shown = 0  # characters released so far
        self._started = False

    @property
    def num_completion_tokens(self) -> int:
        return self._checker.num_tokens

    @property
    def text(self) -> str:
        return self._checker.text if self._final_text is None else self._final_text

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
                self._cut_by_stop_string = self._checker.cut_by_stop_string
                break
        used = len(pieces)
        tokens = {"token_ids": chunk.token_ids[:used],
                  "logprobs": None if chunk.logprobs is None else chunk.logprobs[:used]}  # fmt: skip
        if self._checker.finish_reason is not None:
            return replace(self._finish(self._checker.finish_reason.value, chunk.finish_reason is None), **tokens)
        if chunk.finish_reason is not None:  # the worker ended it
            return replace(self._finish(chunk.finish_reason), **tokens)
        text = "".join(pieces)
        self._num_shown += len(text)
        return Delta(text, **tokens)

    def fail(self) -> Delta:
        """The request failed: release the text not shown yet, with the finish reason "error"."""
        assert self.finish_reason is None, "failed after the text finished"
        return self._finish("error")

    def _finish(self, reason: str, stopped_early: bool = False) -> Delta:
        final = self._checker.text
        if not self._cut_by_stop_string:
            final += self._undecoded_tail()
            cut = _first_stop(final, self._stops, len(self._checker.text))
            if cut is not None:  # the unfinished character's replacement completed a stop string
                final = final[:cut]
                reason = "stop" if reason != "error" else reason
        self._final_text, self.finish_reason = final, reason
        delta = final[self._num_shown :]
        self._num_shown = len(final)
        return Delta(delta, reason, stopped_early)

    def _undecoded_tail(self) -> str:
        """The text of the tokens the incremental decoder still holds (the checker adds
        it itself when it ends the text; a worker's finish or a failure lands here)."""
        return self._checker.undecoded_tail()


def _first_stop(text: str, stops: list[str], ends_after: int) -> int | None:
    """Where in ``text`` the first stop string (in the order given, as StopChecker
    looks) that ends after ``ends_after`` characters starts; None if none does."""
    for stop in stops:
        at = text.find(stop, max(0, ends_after - len(stop) + 1))
        if at != -1:
            return at
    return None


class TokenSource(Protocol):
    """Where in-order chunks come from (dispatch.RequestRun, or a fake in tests)."""

    async def next_chunks(self) -> list[TokenChunk]: ...

    async def cancel(self, reason: str) -> None: ...


async def stream_deltas(source: TokenSource, texts: list[TextStream]) -> AsyncIterator[Delta]:
    """The request's text deltas, one TextStream per sequence (choice), up to and
    including the one with the finish reason of the last to finish."""
    while True:
        for chunk in await source.next_chunks():
            text = texts[chunk.choice]
            if text.finish_reason is not None:
                continue  # a stop string ended this one here while the workers went on
            delta = replace(text.feed(chunk), choice=chunk.choice)
            done = all(t.finish_reason is not None for t in texts)
            if delta.stopped_early and done:  # a stop string: the workers would go on to max_tokens
                await source.cancel("stop")
            yield delta
            if done:
                return
