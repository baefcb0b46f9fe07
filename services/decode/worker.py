"""The decode worker: leases blocks for incoming KV, then decodes every admitted
request in one continuous batch, streaming each token on its request's subject.

Requests join the batch between any two steps and leave it the step they
finish or are cancelled; their blocks go back to the pool at once.
"""

import asyncio
from contextlib import AsyncExitStack

from nats.aio.msg import Msg

from libs.common import subjects
from libs.common.engine_host import EngineHost
from libs.common.errors import OutOfKVBlocksError
from libs.common.model.sampling import sample
from libs.common.model.sequence import Sequence
from libs.common.model.stopping import check_finish
from libs.common.recent import RecentIds
from libs.common.schema import (
    Ack,
    Cancel,
    ErrorInfo,
    ErrorReply,
    HandoffRequest,
    DecodeBeat,
    Heartbeat,
    ReleaseRequest,
    ReserveReply,
    ReserveRequest,
    TokenChunk,
)
from libs.common.service import Service
from libs.common.vocabulary import ErrorCode, FinishReason
from libs.common.worker_metrics import WorkerMetrics
from services.decode.leases import LeaseTable
from services.decode.local_prefill import LocalPrefill
from services.decode.settings import DecodeSettings


class DecodeWorker(Service):
    settings: DecodeSettings

    def __init__(self, settings: DecodeSettings) -> None:
        super().__init__(settings)
        self.host = EngineHost.create(
            settings.model, self.instance_id, settings.host_id, settings.transfer, enable_prefix_cache=settings.enable_prefix_cache,
            metrics=self.metrics,
        )
        self.engine = self.host.engine
        self.eos_ids = set(self.host.loaded.tokenizer.eos_token_ids)
        self.leases = LeaseTable(settings.lease_seconds)
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []  # preempted: their KV is recomputed when blocks free up
        self.worker_metrics = WorkerMetrics(self.metrics, self.engine.cache.block_pool,
                                            num_running=lambda: len(self.running), num_waiting=lambda: len(self.waiting))
        self.cancelled = RecentIds()
        self._work = asyncio.Event()
        self._blocks_freed = asyncio.Condition()
        self.local_prefill = LocalPrefill(self, settings.model.calibrate)  # cost model; prefills the conductor sends here

    async def start(self, stack: AsyncExitStack) -> None:
        stack.callback(self.host.close)
        await self.local_prefill.start(stack)
        me = self.instance_id
        await self.subscribe(subjects.decode_reserve(me), ReserveRequest, self.on_reserve)
        await self.subscribe(subjects.decode_admit(me), HandoffRequest, self.on_handoff)
        await self.subscribe(subjects.decode_release(me), ReleaseRequest, self.on_release)
        await self.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        loop = self.spawn(self._decode_loop())
        expiry = self.spawn(self._expire_leases())
        stack.callback(loop.cancel)
        stack.callback(expiry.cancel)

    # --- hand-off --------------------------------------------------------------
    async def on_reserve(self, request: ReserveRequest, msg: Msg) -> ReserveReply | ErrorReply:
        if mismatch := self.host.contract.mismatch(request.contract):
            return ErrorReply(code=ErrorCode.CONTRACT_MISMATCH, message=f"{self.instance_id}: {mismatch}")
        needed = self.engine.cache.blocks_needed(request.num_tokens)
        if needed > self.engine.cache.block_pool.num_blocks:
            return ErrorReply(code=ErrorCode.NO_CAPACITY, message="the prompt is larger than this worker's KV pool")
        pool = self.engine.cache.block_pool
        try:
            async with asyncio.timeout(self.settings.reserve_wait_seconds), self._blocks_freed:
                while True:
                    await self._blocks_freed.wait_for(lambda: pool.can_allocate(needed))
                    try:
                        block_ids = await self.host.run(pool.allocate, needed)
                        break
                    except OutOfKVBlocksError:  # a decode step took them first
                        continue
        except TimeoutError:
            return ErrorReply(code=ErrorCode.NO_CAPACITY, message=f"{self.instance_id} has no free KV blocks")
        if request.request_id in self.cancelled:
            await self._free(block_ids)
            return ErrorReply(code=ErrorCode.CANCELLED, message="the request was cancelled")
        ticket = self.host.transfers.expect(self.host.segment.name, self.host.block_ranges(block_ids),
                                            ttl=self.leases.lease_seconds, sender_host=request.host_id)  # fmt: skip
        lease = self.leases.grant(request.request_id, block_ids, ticket.token)
        return ReserveReply(block_ids=lease.block_ids, ticket=ticket, lease_seconds=self.leases.lease_seconds)

    async def on_handoff(self, request: HandoffRequest, msg: Msg) -> Ack | ErrorReply:
        lease = self.leases.take(request.request_id)
        if lease is None or lease.block_ids != request.block_ids:
            if lease is not None:
                await self._end_lease(lease)
            return ErrorReply(code=ErrorCode.NO_LEASE, message=f"no live lease for {request.request_id}")
        if lease.ticket_token is not None:
            self.host.transfers.close_ticket(lease.ticket_token)  # the KV is in: no more writes
        if request.request_id in self.cancelled:
            await self._free(lease.block_ids)
            return Ack()
        seq = Sequence(
            request_id=request.request_id,
            token_ids=list(request.token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            params=request.sampling,
            block_table=lease.block_ids,
            num_computed_tokens=len(request.token_ids) - 1,  # every token but the first generated one
            num_cached_tokens=request.num_cached_tokens,
        )
        self.running.append(seq)
        self._work.set()
        return Ack()

    async def on_release(self, request: ReleaseRequest, msg: Msg) -> None:
        lease = self.leases.take(request.request_id)
        if lease is not None:
            await self._end_lease(lease)

    async def on_cancel(self, request: Cancel, msg: Msg) -> None:
        self.cancelled.add(request.request_id)
        lease = self.leases.take(request.request_id)
        if lease is not None:
            await self._end_lease(lease)
        self._work.set()  # the loop drops a cancelled running sequence before its next step

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for lease in self.leases.expired():
                self.log.warning("lease for %s expired; freeing %d blocks", lease.request_id, len(lease.block_ids))
                await self._end_lease(lease)

    async def _end_lease(self, lease) -> None:
        """A lease that will not be handed over: refuse further writes, free its blocks."""
        if lease.ticket_token is not None:
            self.host.transfers.close_ticket(lease.ticket_token)
        await self._free(lease.block_ids)

    async def _free(self, block_ids: list[int]) -> None:
        await self.host.run(self.engine.cache.block_pool.free, block_ids)
        async with self._blocks_freed:
            self._blocks_freed.notify_all()

    # --- the batch -------------------------------------------------------------
    async def _decode_loop(self) -> None:
        while True:
            await self._work.wait()
            await self._drop_cancelled()
            if self.waiting:
                for seq, token in await self.host.run(self._resume, list(self.waiting)):
                    self.waiting.remove(seq)
                    self.running.append(seq)
                    await self._emit([seq], [token])
            if not self.running:
                if self.waiting:  # preempted work that does not fit yet: wait for blocks
                    async with self._blocks_freed:
                        await self._blocks_freed.wait()
                else:
                    self._work.clear()
                continue
            batch = self.running[: self.settings.max_batch_size]
            try:
                tokens = await self.host.run(self._decode, batch)
            except OutOfKVBlocksError:
                await self._preempt_newest()
                continue
            await self._emit(batch, tokens)

    def _resume(self, waiting: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Engine thread: recompute the KV of preempted sequences that fit again;
        each gets its next token from that prefill."""
        resumed = []
        for seq in waiting:
            if not self.engine.cache.can_allocate(seq, seq.num_tokens + self.engine.block_size):
                break
            logits = self.engine.prefill([seq])
            resumed.append((seq, sample(logits, [seq.params], [seq.num_output_tokens])[0]))
        return resumed

    def _decode(self, batch: list[Sequence]) -> list[int]:
        """Engine thread: one decode step for the batch, sampled."""
        logits = self.engine.decode_step(batch)
        return sample(logits, [s.params for s in batch], [s.num_output_tokens for s in batch])

    async def _emit(self, batch: list[Sequence], tokens: list[int]) -> None:
        finished = []
        for seq, token in zip(batch, tokens):
            seq.append_token(token)
            reason = check_finish(seq, self.eos_ids, self.engine.max_model_len)
            await self.publish(
                subjects.tokens(seq.request_id),
                TokenChunk(request_id=seq.request_id, index=seq.num_output_tokens - 1, token_ids=[token],
                           finish_reason=reason.value if reason else None, instance_id=self.instance_id),
            )  # fmt: skip
            if reason is not None:
                finished.append(seq)
        for seq in finished:
            await self._retire(seq)

    async def _retire(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        await self.host.run(self.engine.cache.free, seq)
        async with self._blocks_freed:
            self._blocks_freed.notify_all()

    async def _drop_cancelled(self) -> None:
        for seq in [s for s in self.running + self.waiting if s.request_id in self.cancelled]:
            seq.finish_reason = FinishReason.ABORT
            if seq in self.waiting:
                self.waiting.remove(seq)
            await self._retire(seq)

    async def _preempt_newest(self) -> None:
        seq = self.running.pop()
        self.log.warning("KV pool full: preempting %s (its KV is recomputed later)", seq.request_id)
        await self.host.run(self._reset, seq)
        self.waiting.insert(0, seq)
        if not self.running:
            # alone and still no room: it can never fit
            self.waiting.remove(seq)
            await self.publish(subjects.tokens(seq.request_id), TokenChunk(
                request_id=seq.request_id, index=seq.num_output_tokens, finish_reason=FinishReason.ABORT.value,
                instance_id=self.instance_id,
                error=ErrorInfo(code=ErrorCode.NO_CAPACITY, message="the sequence outgrew the decode worker's KV pool")))  # fmt: skip

    def _reset(self, seq: Sequence) -> None:
        self.engine.cache.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.block_hashes = []

    def heartbeat(self) -> Heartbeat:
        beat = super().heartbeat()
        pool = self.engine.cache.block_pool
        beat.payload = DecodeBeat(
            load=len(self.running) + len(self.waiting) + len(self.leases), capacity=pool.num_blocks,
            free_blocks=pool.num_free_blocks, segment=self.host.segment.name, contract=self.host.contract,
        )  # fmt: skip
        self.local_prefill.fill(beat.payload)
        return beat
