"""Hands a request's KV to its decode worker: lease blocks there, copy the
prompt's blocks into them through the transfer engine, then hand the request
over. Every failure becomes a HandoffError with a code the gateway can map."""

from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

from libs.common import subjects
from libs.common.engine_host import EngineHost
from libs.common.model.sequence import Sequence
from libs.common.schema import Ack, BadMessageError, HandoffRequest, PrefillRequest, ReleaseRequest, ReserveReply, ReserveRequest
from libs.common.service import Service
from libs.common.transfer import Descriptor, TransferError

RESERVE_TIMEOUT = 15.0  # the decode worker waits up to 10 s for blocks before saying no
HANDOFF_TIMEOUT = 5.0


class HandoffError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Handoff:
    def __init__(self, service: Service, host: EngineHost) -> None:
        self.service = service
        self.host = host

    async def reserve(self, request: PrefillRequest, num_tokens: int) -> ReserveReply:
        message = ReserveRequest(request_id=request.request_id, num_tokens=num_tokens,
                                 prefill_id=self.service.instance_id, contract=self.host.contract)  # fmt: skip
        try:
            reply = await self.service.request(subjects.decode_reserve(request.decode_id), message, ReserveReply,
                                               timeout=RESERVE_TIMEOUT)  # fmt: skip
        except (NoRespondersError, NatsTimeout) as e:
            raise HandoffError("decode_unavailable", f"decode worker {request.decode_id} did not answer ({e})") from e
        except BadMessageError as e:
            raise HandoffError("internal", str(e)) from e
        if reply.error is not None:
            raise HandoffError(reply.error.code, reply.error.message)
        return reply

    async def send(self, request: PrefillRequest, seq: Sequence, lease: ReserveReply) -> None:
        """Copy the prompt's KV into the leased blocks, then hand the request over."""
        pool, block_nbytes = self.host.engine.pool, self.host.block_nbytes
        num_blocks = self.host.engine.cache.blocks_needed(seq.num_prompt_tokens)
        batch = [
            Descriptor(self.host.segment.name, pool.block_range(src)[0], lease.segment, dst * block_nbytes, block_nbytes)
            for src, dst in zip(seq.block_table[:num_blocks], lease.block_ids)
        ]
        try:
            await self.host.transfers.transfer(batch)
        except TransferError as e:
            await self.release(request, lease)
            raise HandoffError(e.cause, f"KV transfer to {request.decode_id} failed: {e}") from e
        handoff = HandoffRequest(
            request_id=request.request_id,
            token_ids=seq.token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            sampling=request.sampling,
            block_ids=lease.block_ids,
        )
        try:
            ack = await self.service.request(subjects.decode_admit(request.decode_id), handoff, Ack,
                                             timeout=HANDOFF_TIMEOUT)  # fmt: skip
        except (NoRespondersError, NatsTimeout, BadMessageError) as e:
            raise HandoffError("decode_unavailable", f"decode worker {request.decode_id} did not take the request ({e})") from e
        if ack.error is not None:
            raise HandoffError(ack.error.code, ack.error.message)

    async def release(self, request: PrefillRequest, lease: ReserveReply | None) -> None:
        """Give an unused lease back (the request ended at its first token, or failed)."""
        if lease is not None:
            await self.service.publish(subjects.decode_release(request.decode_id), ReleaseRequest(request_id=request.request_id))
