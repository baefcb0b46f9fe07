"""Puts one request's TokenChunks back in generation order.

The prefill worker publishes the first token and the decode worker the rest,
so chunks can arrive out of order (and, after a retry, twice). Chunks are held
until they are contiguous; tokens already delivered are trimmed away. Knows
nothing of NATS or text.
"""

import msgspec

from libs.protocol.schema import TokenChunk


class ChunkReorderer:
    def __init__(self) -> None:
        self.next_index = 0  # generated tokens delivered so far
        self.finished = False  # a chunk with a finish_reason has been delivered
        self._held: dict[int, TokenChunk] = {}

    @property
    def num_held(self) -> int:
        return len(self._held)

    def push(self, chunk: TokenChunk) -> list[TokenChunk]:
        """The chunks that are now in order (possibly none), each starting at the
        token after the previous one; nothing is delivered after a finish."""
        if self.finished:
            return []
        held = self._held.get(chunk.index)
        if held is None or _covers_more(chunk, held):
            self._held[chunk.index] = chunk
        ready: list[TokenChunk] = []
        while self._held and not self.finished:
            first = min(self._held)
            if first > self.next_index:
                break  # a gap: wait for the chunk that fills it
            trimmed = _trim(self._held.pop(first), self.next_index)
            if trimmed is None:
                continue  # nothing new in it
            ready.append(trimmed)
            self.next_index += len(trimmed.token_ids)
            self.finished = trimmed.finish_reason is not None
        if self.finished:
            self._held.clear()
        return ready


def _trim(chunk: TokenChunk, next_index: int) -> TokenChunk | None:
    """``chunk`` without the tokens before ``next_index``; None if nothing is left."""
    skip = next_index - chunk.index
    if skip == 0:
        return chunk
    tokens = chunk.token_ids[skip:]
    if not tokens and chunk.finish_reason is None:
        return None
    logprobs = None if chunk.logprobs is None else chunk.logprobs[skip:]
    return msgspec.structs.replace(chunk, index=next_index, token_ids=tokens, logprobs=logprobs)


def _covers_more(new: TokenChunk, old: TokenChunk) -> bool:
    """Of two chunks at the same index, keep the one that reaches further (or finishes)."""
    if len(new.token_ids) != len(old.token_ids):
        return len(new.token_ids) > len(old.token_ids)
    return old.finish_reason is None and new.finish_reason is not None
