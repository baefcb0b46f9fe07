"""The prefill worker: computes each request's KV (reusing cached prefix blocks
from its own cache, then from the store), samples the first token, and hands
the KV to the decode worker the conductor chose.

Per request: prepare (local prefix hit, store fetch, decode lease) -> compute
(batched with whatever else is waiting) -> finish (first token out, KV copied
into the decode worker's leased blocks, hand-over, new blocks to the store).
Finishing overlaps the next batch's compute.
"""

import asyncio
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

from nats.aio.msg import Msg

from libs.common import failpoints, subjects
from libs.common.engine_host import EngineHost
from libs.common.errors import KVServeError
from libs.common.model.scheduler import TokenOutput, sample_tokens, token_stop
from libs.common.model.sequence import Sequence
from libs.common.recent import RecentIds
from libs.common.peers import PeerDirectory
from libs.common.schema import Ack, Cancel, ErrorInfo, ErrorReply, Heartbeat, PrefillBeat, PrefillRequest
from libs.common.service import Service
from libs.common.token_chunks import error_chunk, token_chunk
from libs.common.vocabulary import ErrorCode, KVTier, Role
from libs.common.worker_metrics import WorkerMetrics
from services.prefill.handoff import Handoff, HandoffError, Transfer
from services.prefill.kv_reports import KVReports
from services.prefill.settings import PrefillSettings
from services.prefill.store_client import StoreClient


@dataclass
class Job:
    request: PrefillRequest
    seq: Sequence
    transfer: Transfer | None = None  # the hand-off to the decode worker, once leased


class PrefillWorker(Service):
    settings: PrefillSettings

    def __init__(self, settings: PrefillSettings) -> None:
        super().__init__(settings)
        self.host = EngineHost.create(
            settings.model, self.instance_id, settings.host_id, settings.transfer,
            max_chunk_tokens=settings.max_chunk_tokens, enable_prefix_cache=settings.enable_prefix_cache,
            metrics=self.metrics, decodes=False,
        )  # fmt: skip
        self.engine = self.host.engine
        self.finish_rule = token_stop(set(self.host.loaded.tokenizer.eos_token_ids), self.engine.max_model_len)
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self.in_flight: dict[str, Job] = {}
        self.worker_metrics = WorkerMetrics(self.metrics, self.engine.cache.block_pool,
                                            num_running=lambda: len(self.in_flight) - self.queue.qsize(),
                                            num_waiting=self.queue.qsize)  # fmt: skip
        self.cancelled = RecentIds()
        self.store = StoreClient(self, self.host, settings.store_replicas) if settings.use_store else None
        self.handoff = Handoff(self, self.host)
        self.decoders = PeerDirectory()  # for retrying a failed hand-off elsewhere
        self.reports = KVReports(  # KV events and cost model
            self, self.host, settings.model.calibrate, settings.model.calibration_file
        )

    async def start(self, stack: AsyncExitStack) -> None:
        stack.callback(self.host.close)
        await self.reports.start(stack)
        await self.subscribe(subjects.prefill_submit(self.instance_id), PrefillRequest, self.on_submit)
        await self.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        await self.subscribe(subjects.heartbeat(Role.DECODE), Heartbeat, self.on_decode_heartbeat)
        if self.store is not None:
            await self.store.start(self.reports.cost)
        loop = self.spawn(self._prefill_loop(), essential=True)
        stack.callback(loop.cancel)

    async def on_submit(self, request: PrefillRequest, msg: Msg) -> Ack | ErrorReply:
        try:
            request.sampling.validate()
            self.engine.check_prompt(len(request.prompt_token_ids))
        except KVServeError as e:
            return ErrorReply(code=ErrorCode.INVALID_REQUEST, message=str(e))
        seq = Sequence.from_prompt(request.request_id, request.prompt_token_ids, request.sampling)
        job = Job(request, seq)
        self.in_flight[request.request_id] = job
        self.queue.put_nowait(job)
        return Ack()

    async def on_cancel(self, request: Cancel, msg: Msg) -> None:
        self.cancelled.add(request.request_id)

    async def on_decode_heartbeat(self, heartbeat: Heartbeat, msg: Msg) -> None:
        self.decoders.observe(heartbeat)

    # --- the loop --------------------------------------------------------------
    async def _prefill_loop(self) -> None:
        while True:
            jobs = [await self.queue.get()]
            budget = self.settings.max_batch_tokens - jobs[0].seq.num_tokens
            while not self.queue.empty() and budget > 0:
                job = self.queue.get_nowait()
                jobs.append(job)
                budget -= job.seq.num_tokens
            ready = [job for job in await asyncio.gather(*(self._prepare(j) for j in jobs)) if job is not None]
            if not ready:
                continue
            new_tokens, started = sum(j.seq.num_tokens - j.seq.num_computed_tokens for j in ready), time.perf_counter()
            try:
                outputs = await self.host.run(self._compute, ready)
                if self.store is not None:  # the speed a store fetch must beat
                    self.store.policy.observe_prefill(new_tokens, time.perf_counter() - started)
            except Exception as e:
                self.log.exception("prefill of %d requests failed", len(ready))
                for job in ready:
                    await self._fail(job, ErrorInfo(code=ErrorCode.INTERNAL, message=f"prefill failed: {e}"))
                continue
            for job, out in zip(ready, outputs):
                self.spawn(self._finish(job, out))

    async def _prepare(self, job: Job) -> Job | None:
        """Reuse cached blocks (local, then store) and lease room on the decode worker."""
        if failpoints.active("prefill.stall_before_compute"):
            self.log.warning("failpoint prefill.stall_before_compute: holding %s", job.request.request_id)
            await self.stopping.wait()  # a hung worker: it still sends heartbeats, never a token
            return None
        if job.request.request_id in self.cancelled:
            await self._drop(job)
            return None
        seq = job.seq
        try:
            await self.host.run(self._attach_local_prefix, seq)
        except KVServeError as e:
            await self._fail(job, ErrorInfo(code=ErrorCode.NO_CAPACITY, message=str(e)))
            return None
        hits = {KVTier.DEVICE: seq.num_cached_tokens}
        if self.store is not None:
            hits |= await self.store.fetch_prefix(seq)
        self.worker_metrics.prefix_lookup(seq.num_prompt_tokens, hits)
        try:
            job.transfer = await self._lease(job)
        except HandoffError as e:
            await self._fail(job, ErrorInfo(code=e.code, message=str(e)))
            return None
        try:
            await self.handoff.start_streaming(job.transfer)
        except HandoffError as e:
            self.log.warning("cannot stream %s's KV layer by layer (%s); it goes whole after the prefill",
                             job.request.request_id, e)  # fmt: skip
        return job

    async def _lease(self, job: Job, exclude: frozenset[str] = frozenset()) -> Transfer:
        """Lease blocks on the chosen decode worker, or (once) on another live one if it fails."""
        first = job.request.decode_id if job.request.decode_id not in exclude else None
        if first is not None:
            try:
                return await self.handoff.reserve(job.request, first, job.seq.num_prompt_tokens)
            except HandoffError as e:
                self.log.warning("lease for %s on %s failed: %s", job.request.request_id, first, e)
                error = e
        others = self.decoders.alive(Role.DECODE, exclude={*exclude, job.request.decode_id})
        if not others or job.request.request_id in self.cancelled:
            raise error if first is not None else HandoffError(ErrorCode.NO_DECODE, "no other decode worker is alive")
        return await self.handoff.reserve(job.request, others[0].instance_id, job.seq.num_prompt_tokens)

    def _attach_local_prefix(self, seq: Sequence) -> None:
        """Engine thread: take this worker's cached prefix blocks and allocate the rest."""
        self.engine.cache.match_prefix(seq)
        self.engine.cache.allocate(seq, seq.num_tokens)

    def _compute(self, jobs: list[Job]) -> list[TokenOutput]:
        """Engine thread: prefill the batch, shipping each layer's KV to its decode
        worker as soon as it is computed; sample each first token."""
        by_seq = {id(job.seq): job for job in jobs}

        def ship(layer: int, done: list[Sequence]) -> None:
            for seq in done:
                transfer = by_seq[id(seq)].transfer
                if transfer.writer is not None:
                    transfer.writer.submit(self.handoff.layer_spans(transfer, seq, layer))

        seqs = [job.seq for job in jobs]
        logits = self.engine.prefill(seqs, layer_done=ship)
        return sample_tokens(seqs, logits, self.finish_rule)

    async def _finish(self, job: Job, out: TokenOutput) -> None:
        seq, request_id = job.seq, job.request.request_id
        cancelled = request_id in self.cancelled
        if not cancelled:
            await self.publish(subjects.tokens(request_id), token_chunk(out, self.instance_id))
        if out.finish_reason is not None or cancelled or request_id in self.cancelled:
            await self.handoff.release(job.transfer)
        else:
            await self._hand_over(job)
        if self.store is not None:
            await self.store.write_back(seq)  # holds the blocks until the store has the bytes
        await self._drop(job)

    async def _hand_over(self, job: Job) -> None:
        """Finish the hand-off; if it fails, retry once on another decode worker."""
        request_id = job.request.request_id
        try:
            await self.handoff.complete(job.transfer, job.seq)
            return
        except HandoffError as e:
            failed, error = job.transfer.decode_id, e
            self.log.warning("hand-off of %s to %s failed: %s", request_id, failed, e)
        if request_id not in self.cancelled and self.decoders.alive(Role.DECODE, exclude={failed}):
            try:
                job.transfer = await self._lease(job, exclude=frozenset({failed}))
                await self.handoff.complete(job.transfer, job.seq)
                self.log.info("hand-off of %s retried on %s", request_id, job.transfer.decode_id)
                return
            except HandoffError as e:
                error = e
                self.log.warning("retry of %s failed too: %s", request_id, e)
        chunk = error_chunk(request_id, 1, error.code, str(error), self.instance_id)
        await self.publish(subjects.tokens(request_id), chunk)

    async def _fail(self, job: Job, error: ErrorInfo) -> None:
        self.log.warning("request %s failed: %s", job.request.request_id, error.message)
        if job.transfer is not None:
            await self.handoff.release(job.transfer)
        chunk = error_chunk(job.request.request_id, 0, error.code, error.message, self.instance_id)
        await self.publish(subjects.tokens(job.request.request_id), chunk)
        await self._drop(job)

    async def _drop(self, job: Job) -> None:
        self.in_flight.pop(job.request.request_id, None)
        if job.seq.block_table:
            await self.host.run(self.engine.cache.free, job.seq)

    def heartbeat(self) -> Heartbeat:
        beat = super().heartbeat()
        cache = self.engine.cache
        beat.payload = PrefillBeat(
            load=len(self.in_flight), capacity=cache.num_blocks, free_blocks=cache.num_free_blocks,
            segment=self.host.segment.name, contract=self.host.contract,
            queued_tokens=sum(j.seq.num_prompt_tokens - j.seq.num_computed_tokens for j in self.in_flight.values()
                              if j.seq.num_computed_tokens < j.seq.num_prompt_tokens),
        )  # fmt: skip
        self.reports.fill(beat.payload)
        return beat

