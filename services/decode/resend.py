"""A stream's tokens published again from an index: what a decode worker answers when
the gateway lost some to a NATS outage (published while either side was reconnecting).
Cheaper than moving the request, which re-prefills it: the worker still holds the
tokens, of a running sequence or, for a while, of one that just finished.
"""

import time
from collections import OrderedDict
from dataclasses import dataclass

from libs.engine.model.sequence import Sequence
from libs.protocol.ids import InstanceId, RequestId
from libs.protocol.schema import TokenChunk
from libs.protocol.vocabulary import FinishReason

KEEP_FINISHED = 1024  # finished streams remembered, newest last
KEEP_FINISHED_S = 60.0  # ... for at most this long


@dataclass(frozen=True)
class _Finished:
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_prompt_tokens: int
    at: float


class FinishedStreams:
    """The generated tokens of recently finished sequences, bounded in count and age."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._streams: OrderedDict[str, _Finished] = OrderedDict()

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, seq: Sequence) -> None:
        assert seq.finish_reason is not None
        if seq.choice or seq.params.n > 1:
            return  # a request for n > 1 sequences is not sent again
        self._streams[seq.request_id] = _Finished(tuple(seq.output_token_ids), seq.finish_reason,
                                                  seq.num_prompt_tokens, self._clock())  # fmt: skip
        self._streams.move_to_end(seq.request_id)
        self._trim()

    def get(self, request_id: RequestId) -> _Finished | None:
        self._trim()
        return self._streams.get(request_id)

    def _trim(self) -> None:
        oldest = self._clock() - KEEP_FINISHED_S
        while self._streams and (len(self._streams) > KEEP_FINISHED or next(iter(self._streams.values())).at < oldest):
            self._streams.popitem(last=False)


def resend_chunk(request_id: RequestId, from_index: int, running: list[Sequence], finished: FinishedStreams,
                 instance_id: InstanceId) -> TokenChunk | None:  # fmt: skip
    """One chunk with the tokens from ``from_index`` on (and the finish reason, if it has
    finished); None if the request is neither running here nor recently finished."""
    seq = next((s for s in running if s.request_id == request_id and s.choice == 0), None)  # n = 1 only
    if seq is not None:
        tokens, reason, num_prompt = list(seq.output_token_ids), None, seq.num_prompt_tokens
    elif (done := finished.get(request_id)) is not None:
        tokens, reason, num_prompt = list(done.token_ids), done.finish_reason, done.num_prompt_tokens
    else:
        return None
    start = min(max(from_index, 0), len(tokens))
    return TokenChunk(request_id=request_id, index=start, token_ids=tokens[start:], finish_reason=reason,
                      num_prompt_tokens=num_prompt if start == 0 else 0, instance_id=instance_id)  # fmt: skip
