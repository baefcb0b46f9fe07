"""The decode worker: leases blocks for incoming KV, then decodes every admitted
request in one continuous batch, streaming each token on its request's subject.

Requests join the batch between any two steps and leave it the step they
finish or are cancelled; their blocks go back to the pool at once.
"""

import asyncio
from contextlib import AsyncExitStack

from nats.aio.msg import Msg

from libs.common.recent import RecentIds
from libs.common.service import Service
from libs.engine.engine_host import EngineHost
from libs.engine.model.grammar import GrammarCompiler
from libs.engine.model.scheduler import Due, Scheduler, StepFailed, run_step, token_stop
from libs.engine.model.sequence import Sequence
from libs.engine.token_chunks import error_chunk, token_chunk
from libs.engine.worker_metrics import WorkerMetrics
from libs.protocol import subjects
from libs.protocol.errors import KVServeError, OutOfKVBlocksError
from libs.protocol.hashing import ROOT
from libs.protocol.schema import (
    Ack,
    Cancel,
    DecodeBeat,
    ErrorReply,
    HandoffRequest,
    Heartbeat,
    ReleaseRequest,
    ResendRequest,
    ReserveReply,
    ReserveRequest,
)
from libs.protocol.vocabulary import ErrorCode
from services.decode.leases import LeaseTable
from services.decode.local_prefill import LocalPrefill
from services.decode.resend import FinishedStreams, resend_chunk
from services.decode.settings import DecodeSettings


class DecodeWorker(Service):
    settings: DecodeSettings

    def __init__(self, settings: DecodeSettings) -> None:
        super().__init__(settings)
        self.host = EngineHost.create(
            settings.model, self.instance_id, settings.host_id, settings.transfer,
            max_chunk_tokens=settings.local_chunk_tokens, enable_prefix_cache=settings.enable_prefix_cache,
            metrics=self.metrics,
        )
        self.engine = self.host.engine
        self.eos_ids = set(self.host.loaded.tokenizer.eos_token_ids)
        self.leases = LeaseTable(settings.lease_seconds)
        # the batch: changed on the engine thread only (through host.run); heartbeats read it
        self.local_prefill = LocalPrefill(self, settings.model.calibrate)  # cost model; prefills the conductor sends here
        self.grammars = GrammarCompiler(self.host.loaded.tokenizer, self.engine.model.config.vocab_size)
        self.scheduler = Scheduler(self.engine.cache, token_stop(self.eos_ids, self.engine.max_model_len),
                                   settings.max_batch_size, self.local_prefill.prefill_time,
                                   eos_token_ids=self.eos_ids, grammars=self.grammars)  # fmt: skip
        self.worker_metrics = WorkerMetrics(self.metrics, self.engine.cache.block_pool,
                                            num_running=lambda: len(self.scheduler.running),
                                            num_waiting=lambda: len(self.scheduler.waiting))
        self.cancelled = RecentIds()
        self.finished = FinishedStreams()  # what a resend after a NATS outage may still ask for
        self._work = asyncio.Event()
        self._blocks_freed = asyncio.Condition()

    async def start(self, stack: AsyncExitStack) -> None:
        stack.callback(self.host.close)
        await self.local_prefill.start(stack)
        me = self.instance_id
        await self.subscribe(subjects.decode_reserve(me), ReserveRequest, self.on_reserve)
        await self.subscribe(subjects.decode_admit(me), HandoffRequest, self.on_handoff)
        await self.subscribe(subjects.decode_release(me), ReleaseRequest, self.on_release)
        await self.subscribe(subjects.decode_resend(me), ResendRequest, self.on_resend)
        await self.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        loop = self.spawn(self._decode_loop(), essential=True)
        expiry = self.spawn(self._expire_leases(), essential=True)
        stack.callback(loop.cancel)
        stack.callback(expiry.cancel)
        self.warm_in_background(self.grammars.warm)

    # --- hand-off --------------------------------------------------------------
    async def on_reserve(self, request: ReserveRequest, msg: Msg) -> ReserveReply | ErrorReply:
        if mismatch := self.host.contract.mismatch(request.contract):
            return ErrorReply(code=ErrorCode.CONTRACT_MISMATCH, message=f"{self.instance_id}: {mismatch}")
        cache = self.engine.cache
        needed = cache.blocks_needed(request.num_tokens)
        if needed > cache.num_blocks:
            return ErrorReply(code=ErrorCode.NO_CAPACITY, message="the prompt is larger than this worker's KV pool")
        try:
            async with asyncio.timeout(self.settings.reserve_wait_seconds), self._blocks_freed:
                while True:
                    await self._blocks_freed.wait_for(lambda: cache.can_allocate_blocks(needed))
                    try:
                        block_ids = await self.host.run(cache.allocate_blocks, needed)
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
            num_prior_output_tokens=request.num_prior_output_tokens,
            hash_root=request.hash_root or ROOT,
        )
        if request.first_token_ids:
            self.spawn(self.admit_choices(seq, request.first_token_ids))
        else:
            self.spawn(self.admit(seq, computed=True))
        return Ack()

    async def on_resend(self, request: ResendRequest, msg: Msg) -> Ack | ErrorReply:
        """Publish a stream's tokens again from ``from_index`` (a NATS outage lost some)."""
        chunk = await self.host.run(resend_chunk, request.request_id, request.from_index, self.scheduler.running,
                                    self.finished, self.instance_id)  # fmt: skip
        if chunk is None:
            return ErrorReply(code=ErrorCode.UNKNOWN_REQUEST, message=f"{request.request_id} is not on {self.instance_id}")
        await self.publish(subjects.tokens(request.request_id, self.instance_id), chunk)
        return Ack()

    async def admit_choices(self, seq: Sequence, first_token_ids: list[int]) -> None:
        """A request for n sequences, handed over: ``seq`` is its first, on the prompt's
        blocks; the others fork from them (sharing the full blocks, copying the last),
        each with its own first token. Those their first token finished (the prefill
        worker said so) are dropped; the rest join the batch."""
        try:
            choices = await self.host.run(self._fork_choices, seq, first_token_ids)
        except OutOfKVBlocksError as e:
            await self._publish_error(seq, ErrorCode.NO_CAPACITY, f"no room for the request's other sequences: {e}")
            await self._blocks_were_freed()
            return
        for choice in choices:
            await self.admit(choice, computed=True)

    def _fork_choices(self, seq: Sequence, first_token_ids: list[int]) -> list[Sequence]:
        """Engine thread: the sequences of `admit_choices` that go on."""
        seq.token_ids.pop()  # the prompt alone: what the blocks hold, and where the others fork
        choices = [seq]
        try:
            for c in range(1, len(first_token_ids)):
                choices.append(self.engine.fork(seq, c))
        except OutOfKVBlocksError:
            for choice in choices:
                self.engine.cache.free(choice)
            raise
        going_on = []
        for choice, token_id in zip(choices, first_token_ids):
            choice.append_token(token_id)
            if self.scheduler.stop(choice) is None:
                going_on.append(choice)
            else:
                self.engine.cache.free(choice)
        return going_on

    async def on_release(self, request: ReleaseRequest, msg: Msg) -> None:
        lease = self.leases.take(request.request_id)
        if lease is not None:
            await self._end_lease(lease)

    async def on_cancel(self, request: Cancel, msg: Msg) -> None:
        self.cancelled.add(request.request_id)
        lease = self.leases.take(request.request_id)
        if lease is not None:
            await self._end_lease(lease)
        if await self.host.run(self.scheduler.abort, request.request_id) is not None:
            await self._blocks_were_freed()

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
        await self.host.run(self.engine.cache.free_blocks, block_ids)
        await self._blocks_were_freed()

    async def _blocks_were_freed(self) -> None:
        """Wake whoever waits for blocks: reservations, and the loop's waiting sequences."""
        async with self._blocks_freed:
            self._blocks_freed.notify_all()
        self._work.set()

    # --- the batch -------------------------------------------------------------
    async def admit(self, seq: Sequence, computed: bool, due: Due | None = None) -> None:
        """Add a sequence to the batch: one whose KV came by hand-off (``computed``),
        or one to prefill here (local prefill), due by ``due``. Its grammar, if any, is
        compiled first, off the engine thread (the sampler finds it cached)."""
        if seq.params.grammar is not None:
            try:
                await asyncio.to_thread(self.grammars.compile, seq.params.grammar)
            except KVServeError as e:
                await self.host.run(self.engine.cache.free, seq)
                await self._publish_error(seq, ErrorCode.INVALID_REQUEST, str(e))
                await self._blocks_were_freed()
                return
        if computed:
            await self.host.run(self.scheduler.add_running, seq)
        else:
            await self.host.run(self.scheduler.add, seq, due)
        if seq.request_id in self.cancelled:  # the cancel came while it was on its way in
            await self.host.run(self.scheduler.abort, seq.request_id)
            await self._blocks_were_freed()
        self._work.set()

    async def _decode_loop(self) -> None:
        while True:
            await self._work.wait()
            self._work.clear()  # anything that can let the batch move on sets it again
            try:
                result = await self.host.run(run_step, self.engine, self.scheduler)
            except StepFailed as e:
                self.log.exception("a step of %d sequences failed", len(e.seqs))
                for seq in e.seqs:
                    await self._publish_error(seq, ErrorCode.INTERNAL, str(e))
                await self._blocks_were_freed()
                continue
            for seq in result.preempted:
                self.log.warning("KV pool full: preempting %s (its KV is recomputed later)", seq.request_id)
            for seq in result.rejected:
                await self._publish_error(seq, ErrorCode.NO_CAPACITY, "the sequence outgrew this worker's KV pool")
            for out in result.outputs:
                chunk = token_chunk(out, self.instance_id)
                await self.publish(subjects.tokens(out.request_id, self.instance_id), chunk)
                if out.finish_reason is not None:
                    self.finished.add(out.seq)
            if result.rejected or result.preempted or any(out.finish_reason is not None for out in result.outputs):
                await self._blocks_were_freed()
            elif result.outputs or result.computed:
                self._work.set()  # more to do (a prompt's next chunk); sequences that did not fit wait for freed blocks

    async def _publish_error(self, seq: Sequence, code: ErrorCode, message: str) -> None:
        chunk = error_chunk(seq.request_id, seq.num_output_tokens, code, message, self.instance_id)
        await self.publish(subjects.tokens(seq.request_id, self.instance_id), chunk)

    def heartbeat(self) -> Heartbeat:
        beat = super().heartbeat()
        cache = self.engine.cache
        beat.payload = DecodeBeat(
            load=self.scheduler.num_requests + len(self.leases), capacity=cache.num_blocks,
            free_blocks=cache.num_free_blocks, segment=self.host.segment.name, contract=self.host.contract,
        )  # fmt: skip
        self.local_prefill.fill(beat.payload)
        return beat
