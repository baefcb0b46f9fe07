"""Hands a request's KV to a decode worker: lease blocks there (with a write
ticket), stream the prompt's KV into them layer by layer while the prefill
computes, then hand the request over.

Each hand-off is an explicit state machine, and every way it can end releases
what it holds on both sides::

    leased -> streaming -> written -> handed over
       \\          \\           \\
        +----------+-----------+--> released (lease given back, writer aborted)

If a hand-off fails (transfer error, timeout, the decode worker gone), the
worker retries once on another live decode worker, shipping whole blocks. A lease
asked of a decode worker that dies before answering (a message routed to a process
being killed is lost) fails as soon as its heartbeats say it is gone, not at the
timeout; if it was restarted, the new process is asked at once. So does a hand-over.
"""

import asyncio
import enum
import time
from dataclasses import dataclass

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from libs.common.peers import PeerDirectory
from libs.common.service import M, Service
from libs.engine.engine_host import EngineHost
from libs.engine.model.sequence import Sequence
from libs.protocol import subjects
from libs.protocol.schema import (
    Ack,
    BadMessageError,
    ErrorReply,
    HandoffRequest,
    Message,
    PrefillRequest,
    ReleaseRequest,
    ReserveReply,
    ReserveRequest,
)
from libs.protocol.vocabulary import ErrorCode
from libs.transfer import Span, TransferError
from libs.transfer.writers import Writer

RESERVE_TIMEOUT = 15.0  # the decode worker waits up to 10 s for blocks before saying no
HANDOFF_TIMEOUT = 5.0
GONE_AFTER_HEARTBEATS = 2.5  # a decode worker silent this many heartbeat intervals is gone (as the gateway says)
LIVENESS_CHECK_S = 0.25  # how often an unanswered lease looks at the decode worker's heartbeats


class HandoffError(Exception):
    def __init__(self, code: ErrorCode, message: str, restarted: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.restarted = restarted  # the decode worker asked was restarted before it answered


class State(enum.Enum):
    LEASED = "leased"
    STREAMING = "streaming"
    WRITTEN = "written"
    HANDED_OVER = "handed_over"
    RELEASED = "released"


@dataclass
class Transfer:
    """One request's hand-off to one decode worker."""

    request: PrefillRequest
    decode_id: str
    lease: ReserveReply
    state: State = State.LEASED
    writer: Writer | None = None
    started_at: float | None = None  # the decode process that leased (its heartbeats' start), when heard

    def restarted(self, decoders: PeerDirectory) -> bool:
        """Whether another process now runs under the decode worker's id than the one that leased."""
        heard = decoders.last_heard(self.decode_id)
        return heard is not None and self.started_at is not None and heard[0].started_at != self.started_at


class Handoff:
    def __init__(self, service: Service, host: EngineHost, decoders: PeerDirectory | None = None,
                 heartbeat_interval: float = 1.0) -> None:  # fmt: skip
        self.service = service
        self.host = host
        self.decoders = decoders if decoders is not None else PeerDirectory()  # the decode workers' heartbeats
        self.silence = GONE_AFTER_HEARTBEATS * heartbeat_interval
        layout = host.engine.pool.layout
        self.block_nbytes, self.layer_nbytes = layout.block_nbytes, layout.layer_nbytes

    async def reserve(self, request: PrefillRequest, decode_id: str, num_tokens: int) -> Transfer:
        message = ReserveRequest(request_id=request.request_id, num_tokens=num_tokens,
                                 prefill_id=self.service.instance_id, contract=self.host.contract,
                                 host_id=self.host.transfers.writer_host_id)  # fmt: skip
        try:
            reply = await self._ask_while_alive(decode_id, subjects.decode_reserve(decode_id), message, ReserveReply,
                                                RESERVE_TIMEOUT)  # fmt: skip
        except (NoRespondersError, NatsTimeout) as e:
            raise HandoffError(ErrorCode.DECODE_UNAVAILABLE, f"decode worker {decode_id} did not answer ({e})") from e
        except BadMessageError as e:
            raise HandoffError(ErrorCode.INTERNAL, str(e)) from e
        if isinstance(reply, ErrorReply):
            raise HandoffError(reply.code, reply.message)
        heard = self.decoders.last_heard(decode_id)
        return Transfer(request, decode_id, reply, started_at=heard[0].started_at if heard is not None else None)

    async def _ask_while_alive(self, decode_id: str, subject: str, message: Message, kind: type[M],
                               timeout: float) -> M | ErrorReply:  # fmt: skip
        """The decode worker's answer, or HandoffError as soon as its heartbeats say the
        process asked is gone (restarted, or silent): its answer will never come."""
        heard = self.decoders.last_heard(decode_id)
        started_at = heard[0].started_at if heard is not None else None
        ask = asyncio.ensure_future(self.service.request(subject, message, kind, timeout=timeout))
        deadline = time.monotonic() + timeout
        try:
            while True:
                done, _ = await asyncio.wait([ask], timeout=min(LIVENESS_CHECK_S, max(0.0, deadline - time.monotonic())))
                if done:
                    return ask.result()
                heard = self.decoders.last_heard(decode_id)
                if heard is None or started_at is None:
                    continue  # never heard: only the timeout can tell
                if heard[0].started_at != started_at:
                    raise HandoffError(ErrorCode.DECODE_UNAVAILABLE, f"decode worker {decode_id} was restarted "
                                       "before it answered", restarted=True)  # fmt: skip
                silent = self.decoders.now() - heard[1]
                if silent >= self.silence:
                    raise HandoffError(ErrorCode.DECODE_UNAVAILABLE,
                                       f"decode worker {decode_id} is gone (no heartbeat for {silent:.1f}s)")
        finally:
            ask.cancel()

    async def start_streaming(self, transfer: Transfer) -> None:
        """Open the writer, so layers can be submitted as they are computed."""
        loop = asyncio.get_running_loop()
        try:  # opening maps the peer's segment (shm) or dials it (tcp): off the event loop
            transfer.writer = await loop.run_in_executor(
                None, self.host.transfers.writer, transfer.lease.ticket, self.host.segment.name
            )
        except TransferError as e:
            raise HandoffError(ErrorCode(e.cause), f"cannot reach decode worker {transfer.decode_id}: {e}") from e
        transfer.state = State.STREAMING

    def layer_spans(self, transfer: Transfer, seq: Sequence, layer: int) -> list[Span]:
        """One layer of every prompt block: a contiguous range per block on both sides."""
        offset = layer * self.layer_nbytes
        return [
            Span(self.host.block_offset(src) + offset, dst * self.block_nbytes + offset, self.layer_nbytes)
            for src, dst in zip(self._prompt_blocks(seq), transfer.lease.block_ids)
        ]

    def block_spans(self, transfer: Transfer, seq: Sequence) -> list[Span]:
        """Every prompt block whole (all layers in one range each)."""
        return [
            Span(self.host.block_offset(src), dst * self.block_nbytes, self.block_nbytes)
            for src, dst in zip(self._prompt_blocks(seq), transfer.lease.block_ids)
        ]

    def _prompt_blocks(self, seq: Sequence) -> list[int]:
        return seq.block_table[: self.host.engine.cache.blocks_needed(seq.num_prompt_tokens)]

    async def complete(self, transfer: Transfer, seq: Sequence, first_token_ids: list[int] = ()) -> None:
        """Wait for the last byte, then hand the request over (for n > 1 with every
        sequence's first token); release everything on failure."""
        try:
            if transfer.writer is None:  # not streamed layer by layer: ship whole blocks now
                await self.start_streaming(transfer)
                transfer.writer.submit(self.block_spans(transfer, seq))
            await self.host.transfers.finish(transfer.writer)
            transfer.state = State.WRITTEN
            await self._hand_over(transfer, seq, list(first_token_ids))
            transfer.state = State.HANDED_OVER
        except TransferError as e:
            await self.release(transfer)
            raise HandoffError(ErrorCode(e.cause), f"KV transfer to {transfer.decode_id} failed: {e}") from e
        except HandoffError:
            await self.release(transfer)
            raise

    async def _hand_over(self, transfer: Transfer, seq: Sequence, first_token_ids: list[int]) -> None:
        handoff = HandoffRequest(
            request_id=transfer.request.request_id,
            token_ids=seq.token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            sampling=transfer.request.sampling,
            block_ids=transfer.lease.block_ids,
            num_prior_output_tokens=seq.num_prior_output_tokens,
            first_token_ids=first_token_ids,
            hash_root=transfer.request.hash_root,
        )
        try:
            ack = await self._ask_while_alive(transfer.decode_id, subjects.decode_admit(transfer.decode_id), handoff,
                                              Ack, HANDOFF_TIMEOUT)  # fmt: skip
        except (NoRespondersError, NatsTimeout, BadMessageError) as e:
            raise HandoffError(ErrorCode.DECODE_UNAVAILABLE, f"decode worker {transfer.decode_id} did not take the request ({e})") from e
        if isinstance(ack, ErrorReply):
            raise HandoffError(ack.code, ack.message)

    async def release(self, transfer: Transfer) -> None:
        """Abort the writer and give the lease back (idempotent)."""
        if transfer.state in (State.RELEASED, State.HANDED_OVER):
            return
        transfer.state = State.RELEASED
        if transfer.writer is not None:
            await self.host.transfers.abort(transfer.writer)
        release = ReleaseRequest(request_id=transfer.request.request_id)
        try:
            await self.service.publish(subjects.decode_release(transfer.decode_id), release)
        except Exception as e:  # the lease expires on its own if this is lost
            self.service.log.warning("could not release the lease on %s: %s", transfer.decode_id, e)
