"""The prefill worker: computes each request's KV (reusing cached prefix blocks
from its own cache, then from the store), samples the first token, and hands
the KV to the decode worker the conductor chose.

Per request: prepare (local prefix hit, store fetch, decode lease) -> compute,
a chunk at a time -> finish (first token out, KV copied into the decode worker's
leased blocks, hand-over, new blocks to the store). Each step computes at most
``max_chunk_tokens`` prompt tokens, taken from the prepared requests in the
order of `libs/common/prefill_order.py`: shortest remaining work first unless
that would make an earlier request miss its TTFT deadline, late ones next,
best effort last. So a short prompt arriving behind a long one waits one step,
not the whole long prompt, and a long prompt keeps its computed KV between its
chunks. While a favored request (its tenant under its share, another's over it)
came in the last ``CONTENDED_S``, the other tenants' steps take at most
``contended_chunk_tokens`` and a favored step only favored prompts. Finishing
overlaps the next step's compute.
"""

import asyncio
import statistics
import time
from collections import deque
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace

import torch
from nats.aio.msg import Msg

from libs.common import failpoints
from libs.common.cpu_share import LOW_PRIORITY_SHARE
from libs.common.peers import PeerDirectory
from libs.common.prefill_order import Work, contended, plan, step, step_tokens
from libs.common.recent import RecentIds
from libs.common.service import Service
from libs.engine.cost_model import CostModel, uncalibrated_coefficients
from libs.engine.engine_host import EngineHost
from libs.engine.model.grammar import GrammarCompiler
from libs.engine.model.scheduler import TokenOutput, sample_tokens, token_stop
from libs.engine.model.sequence import Sequence
from libs.engine.prefill_request import sequence_of
from libs.engine.token_chunks import error_chunk, token_chunk
from libs.engine.worker_metrics import WorkerMetrics
from libs.protocol import subjects
from libs.protocol.errors import KVServeError, OutOfKVBlocksError
from libs.protocol.schema import Ack, Cancel, ErrorInfo, ErrorReply, Heartbeat, PrefillBeat, PrefillRequest, TokenChunk
from libs.protocol.vocabulary import ErrorCode, KVTier, Role
from services.prefill.handoff import Handoff, HandoffError, Transfer
from services.prefill.kv_reports import KVReports
from services.prefill.settings import PrefillSettings
from services.prefill.store_client import StoreClient

SPEED_STEPS = 64  # steps whose measured/predicted time gives the worker's speed
MIN_SPEED_STEPS = 5  # ... and how many it takes before there is one (a step on a shape not seen yet is slow)


class StepSpeed:
    """How much slower than its cost model a worker's steps run: the median of the last
    SPEED_STEPS measured/predicted ratios, 0 (not known) until there are MIN_SPEED_STEPS.
    A median of one or two would be the first steps' (new shapes, start-up work beside
    them), and the conductor scales every prediction for the worker by it."""

    def __init__(self) -> None:
        self.ratios: deque[float] = deque(maxlen=SPEED_STEPS)

    def observe(self, seconds: float, predicted: float) -> None:
        if predicted > 0:
            self.ratios.append(seconds / predicted)

    @property
    def value(self) -> float:
        return statistics.median(self.ratios) if len(self.ratios) >= MIN_SPEED_STEPS else 0.0


@dataclass
class Job:
    request: PrefillRequest
    seq: Sequence
    arrived: float  # the event loop's clock
    deadline: float | None  # when its first token is due; None: best effort
    transfer: Transfer | None = None  # the hand-off to the decode worker, once leased

    @property
    def tokens_left(self) -> int:
        return self.seq.num_tokens - self.seq.num_computed_tokens

    @property
    def progress(self) -> float:
        """The share of its prefill still to compute (1: not started; its cached prefix is no work)."""
        work = self.seq.num_tokens - self.seq.num_cached_tokens
        return self.tokens_left / work if work > 0 and self.seq.block_table else 1.0


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
        self.eos_ids = set(self.host.loaded.tokenizer.eos_token_ids)
        self.finish_rule = token_stop(self.eos_ids, self.engine.max_model_len)
        self.grammars = GrammarCompiler(self.host.loaded.tokenizer, self.engine.model.config.vocab_size)
        self.in_flight: dict[str, Job] = {}  # taken, not yet finished
        self.ready: dict[str, Job] = {}  # prepared: the steps choose their chunks from these
        self.favored_at: float | None = None  # when a favored request (another tenant over its share) last came
        self._work = asyncio.Event()  # a job became ready
        self._blocks_freed = asyncio.Event()  # a job's blocks went back to the pool
        self.step_speed = StepSpeed()
        self.worker_metrics = WorkerMetrics(self.metrics, self.engine.cache.block_pool,
                                            num_running=lambda: len(self.ready),
                                            num_waiting=lambda: len(self.in_flight) - len(self.ready))  # fmt: skip
        self.cancelled = RecentIds()
        self.store = StoreClient(self, self.host, settings.store_replicas) if settings.use_store else None
        self.decoders = PeerDirectory()  # for retrying a failed hand-off elsewhere, and to see a lease's target die
        self.heard_views.append(self.decoders)
        self.handoff = Handoff(self, self.host, self.decoders, settings.heartbeat_interval)
        self.reports = KVReports(  # KV events and cost model
            self, self.host, settings.model.calibrate, settings.model.calibration_file
        )

    async def start(self, stack: AsyncExitStack) -> None:
        stack.callback(self.host.close)
        await self.reports.start(stack)
        await self.subscribe(subjects.prefill_submit(self.instance_id), PrefillRequest, self.on_submit)
        await self.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        await self.subscribe_heartbeats(Role.DECODE, self.on_decode_heartbeat)
        if self.store is not None:
            await self.store.start(self.reports.cost)
        loop = self.spawn(self._prefill_loop(), essential=True)
        stack.callback(loop.cancel)
        self.warm_in_background(self.grammars.warm)

    async def on_submit(self, request: PrefillRequest, msg: Msg) -> Ack | ErrorReply:
        seq = await sequence_of(self.engine, request)
        if isinstance(seq, ErrorReply):
            return seq
        now = asyncio.get_running_loop().time()
        deadline = None if request.ttft_budget_s is None else now + request.ttft_budget_s
        job = Job(request, seq, now, deadline)
        if request.favored:  # another tenant is over its share: keep its steps short a while
            self.favored_at = time.monotonic()
        self.in_flight[request.request_id] = job
        self.spawn(self._make_ready(job))
        return Ack()

    async def on_cancel(self, request: Cancel, msg: Msg) -> None:
        self.cancelled.add(request.request_id)

    async def on_decode_heartbeat(self, heartbeat: Heartbeat, msg: Msg) -> None:
        self.decoders.observe(heartbeat)

    # --- the loop --------------------------------------------------------------
    async def _make_ready(self, job: Job) -> None:
        if await self._prepare(job) is not None:
            self.ready[job.request.request_id] = job
            self._work.set()

    async def _prefill_loop(self) -> None:
        while True:
            if not self.ready:
                self._work.clear()
                await self._work.wait()
                continue
            for request_id in [r for r in self.ready if r in self.cancelled]:
                await self._drop(self.ready.pop(request_id))
            chunk = self._next_chunk(asyncio.get_running_loop().time())
            if not chunk:
                continue
            started = time.perf_counter()
            try:
                finished = await self.host.run(self._compute, chunk)
            except Exception as e:
                self.log.exception("a prefill step of %d requests failed", len(chunk))
                for job, _ in chunk:
                    self.ready.pop(job.request.request_id, None)
                    await self._fail(job, ErrorInfo(code=ErrorCode.INTERNAL, message=f"prefill failed: {e}"))
                continue
            self._observe_step(chunk, time.perf_counter() - started)
            for job, outs in finished:
                self.ready.pop(job.request.request_id, None)
                self.spawn(self._finish(job, outs))

    def _next_chunk(self, now: float) -> list[tuple[Job, int]]:
        """The next step: up to ``max_chunk_tokens`` prompt tokens, from the ready jobs in
        the order `prefill_order.plan` gives them; while favored work came lately, as
        `prefill_order.step` keeps it (``contended_chunk_tokens``)."""
        speed = self.speed or 1.0
        work = [Work(request_id, self.cost.prefill_time(job.tokens_left, job.seq.num_computed_tokens) * speed,
                     job.deadline, job.arrived, job.request.favored)
                for request_id, job in self.ready.items()]  # fmt: skip
        return [(self.ready[key], n)
                for key, n in step(plan(work, now), lambda key: self.ready[key].tokens_left,
                                   self.settings.max_chunk_tokens, self.settings.contended_chunk_tokens,
                                   self.contended)]  # fmt: skip

    @property
    def contended(self) -> bool:
        """Whether a favored request came lately (another tenant is over its share)."""
        return contended(self.favored_at, time.monotonic())

    @property
    def chunk_tokens(self) -> int:
        """The most prompt tokens of a request not favored the next step takes: where a
        favored request that comes next starts (the conductor predicts its wait by it)."""
        return step_tokens(self.settings.max_chunk_tokens, self.settings.contended_chunk_tokens, self.contended)

    @property
    def cost(self) -> CostModel:
        return CostModel(self.reports.cost or uncalibrated_coefficients(self.engine.block_size))

    @property
    def speed(self) -> float:
        """Its steps' measured time over what its cost model predicted (`StepSpeed`); 0: not
        yet known. A worker at low priority beside a decode worker (KVSERVE_LOW_PRIORITY)
        computes at full speed while decoding leaves the core idle and at a quarter of it
        while the decode worker steps, which can start any moment: it never claims more
        than that quarter, so that what the conductor promises on it holds either way."""
        if self.settings.model.low_priority:
            return max(self.step_speed.value, 1 / LOW_PRIORITY_SHARE)
        return self.step_speed.value

    def _observe_step(self, chunk: list[tuple[Job, int]], seconds: float) -> None:
        cost = self.cost
        base = cost.coefficients.prefill_base  # one per step, not per prompt in it
        # each prompt's n tokens came after the num_computed_tokens - n it had before the step
        predicted = base + sum(cost.prefill_time(n, job.seq.num_computed_tokens - n) - base for job, n in chunk)
        if not self.warming:  # a step beside start-up work says little of its speed
            self.step_speed.observe(seconds, predicted)
        if self.store is not None:  # the speed a store fetch must beat
            self.store.policy.observe_prefill(sum(n for _, n in chunk), seconds)

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
        while True:
            try:
                await self.host.run(self._attach_local_prefix, seq)
                break
            except OutOfKVBlocksError as e:  # the jobs ahead hold the pool: wait for one to give its blocks back
                if not self.ready and not any(j.seq.block_table for j in self.in_flight.values()):
                    await self._fail(job, ErrorInfo(code=ErrorCode.NO_CAPACITY, message=str(e)))
                    return None
                self._blocks_freed.clear()
                await self._blocks_freed.wait()
                if job.request.request_id in self.cancelled:
                    await self._drop(job)
                    return None
            except KVServeError as e:
                await self._fail(job, ErrorInfo(code=ErrorCode.NO_CAPACITY, message=str(e)))
                return None
        if seq.params.grammar is not None:  # compiled off the engine thread; the sampler finds it cached
            try:
                await asyncio.to_thread(self.grammars.compile, seq.params.grammar)
            except KVServeError as e:
                await self._fail(job, ErrorInfo(code=ErrorCode.INVALID_REQUEST, message=str(e)))
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
            if error.restarted and job.request.request_id not in self.cancelled:  # ask the new process at once
                return await self.handoff.reserve(job.request, first, job.seq.num_prompt_tokens)
        others = self.decoders.alive(Role.DECODE, exclude={*exclude, job.request.decode_id})
        if not others or job.request.request_id in self.cancelled:
            raise error if first is not None else HandoffError(ErrorCode.NO_DECODE, "no other decode worker is alive")
        return await self.handoff.reserve(job.request, others[0].instance_id, job.seq.num_prompt_tokens)

    def _attach_local_prefix(self, seq: Sequence) -> None:
        """Engine thread: take this worker's cached prefix blocks and allocate the rest
        (or, when the pool cannot hold it, nothing)."""
        cache = self.engine.cache
        cache.match_prefix(seq)
        try:
            cache.allocate(seq, seq.num_tokens)
        except OutOfKVBlocksError:
            cache.free(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            seq.block_hashes = []
            raise

    def _compute(self, chunk: list[tuple[Job, int]]) -> list[tuple[Job, list[TokenOutput]]]:
        """Engine thread: compute one step, shipping each layer of the prompts it
        completes to their decode worker as soon as it is computed; sample their first
        tokens (a request for n sequences: n of them, from its prompt's logits; only
        the decode worker holds the other sequences' KV)."""
        by_seq = {id(job.seq): job for job, _ in chunk}

        def ship(layer: int, done: list[Sequence]) -> None:
            for seq in done:
                transfer = by_seq[id(seq)].transfer
                if transfer.writer is not None:
                    transfer.writer.submit(self.handoff.layer_spans(transfer, seq, layer))

        logits = self.engine.prefill_chunk([(job.seq, n) for job, n in chunk], layer_done=ship)
        if logits is None:
            return []
        done = [job for job, _ in chunk if job.tokens_left == 0]
        seqs, rows = [], []
        for row, job in enumerate(done):
            choices = [job.seq] + [replace(job.seq, token_ids=list(job.seq.token_ids), block_table=[],
                                           block_hashes=[], choice=c, grammar=None)
                                 for c in range(1, job.seq.params.n)]  # fmt: skip
            seqs += choices
            rows += [row] * len(choices)
        if len(seqs) > len(done):
            logits = logits[torch.tensor(rows, device=logits.device)]
        outs = sample_tokens(seqs, logits, self.finish_rule, self.eos_ids, self.grammars)
        return [(job, [out for out in outs if out.seq.request_id == job.request.request_id]) for job in done]

    async def _finish(self, job: Job, outs: list[TokenOutput]) -> None:
        seq, request_id = job.seq, job.request.request_id
        cancelled = request_id in self.cancelled
        if not cancelled:
            for out in outs:
                chunk = token_chunk(out, self.instance_id)
                if out.finish_reason is None and job.transfer is not None:
                    chunk.decode_id = job.transfer.decode_id  # the gateway takes the next tokens from it
                await self.publish(subjects.tokens(request_id, self.instance_id), chunk)
        if all(out.finish_reason is not None for out in outs) or cancelled or request_id in self.cancelled:
            await self.handoff.release(job.transfer)
        else:
            await self._hand_over(job, [out.token_id for out in outs] if len(outs) > 1 else [])
        if self.store is not None:
            # holds the blocks until the store has the bytes
            await self.store.write_back(seq, job.request.cache_owner)
        await self._drop(job)

    async def _hand_over(self, job: Job, first_token_ids: list[int]) -> None:
        """Finish the hand-off; if it fails, retry once on another decode worker (on the same
        one when it no longer holds the lease: restarted under its id, or the lease ran out)."""
        request_id = job.request.request_id
        try:
            await self.handoff.complete(job.transfer, job.seq, first_token_ids)
            return
        except HandoffError as e:
            failed, error = job.transfer.decode_id, e
            self.log.warning("hand-off of %s to %s failed: %s", request_id, failed, e)
        # the same worker id again when the process that leased is gone and another runs under it
        again = error.code == ErrorCode.NO_LEASE or job.transfer.restarted(self.decoders)
        exclude = frozenset() if again else frozenset({failed})
        if request_id not in self.cancelled and self.decoders.alive(Role.DECODE, exclude=exclude):
            try:
                job.transfer = await self._lease(job, exclude=exclude)
                # before the new decode worker can stream: the gateway takes its tokens from here on
                moved = TokenChunk(request_id=request_id, index=1, instance_id=self.instance_id,
                                   decode_id=job.transfer.decode_id)  # fmt: skip
                await self.publish(subjects.tokens(request_id, self.instance_id), moved)
                await self.handoff.complete(job.transfer, job.seq, first_token_ids)
                self.log.info("hand-off of %s retried on %s", request_id, job.transfer.decode_id)
                return
            except HandoffError as e:
                error = e
                self.log.warning("retry of %s failed too: %s", request_id, e)
        chunk = error_chunk(request_id, 1, error.code, str(error), self.instance_id)
        await self.publish(subjects.tokens(request_id, self.instance_id), chunk)

    async def _fail(self, job: Job, error: ErrorInfo) -> None:
        self.log.warning("request %s failed: %s", job.request.request_id, error.message)
        if job.transfer is not None:
            await self.handoff.release(job.transfer)
        chunk = error_chunk(job.request.request_id, 0, error.code, error.message, self.instance_id)
        await self.publish(subjects.tokens(job.request.request_id, self.instance_id), chunk)
        await self._drop(job)

    async def _drop(self, job: Job) -> None:
        self.in_flight.pop(job.request.request_id, None)
        self.ready.pop(job.request.request_id, None)
        if job.seq.block_table:
            await self.host.run(self.engine.cache.free, job.seq)
            self._blocks_freed.set()

    def heartbeat(self) -> Heartbeat:
        beat = super().heartbeat()
        cache = self.engine.cache
        beat.payload = PrefillBeat(
            load=len(self.in_flight), capacity=cache.num_blocks, free_blocks=cache.num_free_blocks,
            segment=self.host.segment.name, contract=self.host.contract,
            queued_tokens=sum(j.seq.num_prompt_tokens - j.seq.num_computed_tokens for j in self.in_flight.values()
                              if j.seq.num_computed_tokens < j.seq.num_prompt_tokens),
            speed=self.speed, chunk_tokens=self.chunk_tokens,
            progress={request_id: job.progress for request_id, job in self.in_flight.items()},
        )  # fmt: skip
        self.reports.fill(beat.payload)
        return beat

