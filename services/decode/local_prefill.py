"""Conditional disaggregation: the decode worker prefills a request itself, when
the conductor predicts that is faster than a prefill worker plus the hand-off
(a short prompt the decode batch can afford to stall for), then decodes it in
its batch like any handed-over request. Also calibrates the worker's cost
model at start-up and reports it, with the batch it is running, in heartbeats.
"""

from nats.aio.msg import Msg

from libs.common import subjects
from libs.common.cost_model import CostModel, calibrate_once
from libs.common.errors import KVServeError
from libs.common.model.sampling import sample
from libs.common.model.sequence import Sequence
from libs.common.model.stopping import check_finish
from libs.common.schema import Ack, CostCoefficients, DecodeBeat, ErrorInfo, ErrorReply, PrefillRequest, TokenChunk
from libs.common.vocabulary import ErrorCode, FinishReason


class LocalPrefill:
    def __init__(self, worker, calibrate_at_start: bool) -> None:
        self.worker = worker  # services.decode.worker.DecodeWorker
        self.calibrate_at_start = calibrate_at_start
        self.cost: CostCoefficients | None = None
        self.num_prefilled = 0

    async def start(self, stack) -> None:
        w = self.worker
        if self.calibrate_at_start:
            self.cost = await w.host.run(calibrate_once, w.engine, w.settings.model.calibration_file)
            w.log.info("cost model: %s", CostModel(self.cost).describe())
        await w.subscribe(subjects.decode_prefill(w.instance_id), PrefillRequest, self.on_prefill)

    async def on_prefill(self, request: PrefillRequest, msg: Msg) -> Ack | ErrorReply:
        engine = self.worker.engine
        try:
            request.sampling.validate()
            engine.check_prompt(len(request.prompt_token_ids))
        except KVServeError as e:
            return ErrorReply(code=ErrorCode.INVALID_REQUEST, message=str(e))
        seq = Sequence.from_prompt(request.request_id, request.prompt_token_ids, request.sampling)
        if not engine.cache.can_allocate(seq, seq.num_tokens + engine.block_size):
            return ErrorReply(code=ErrorCode.NO_CAPACITY, message=f"{self.worker.instance_id} has no free KV blocks")
        self.worker.spawn(self._prefill(seq))
        return Ack()

    async def _prefill(self, seq: Sequence) -> None:
        w = self.worker
        try:
            token = await w.host.run(self._compute, seq)
        except KVServeError as e:
            await self._publish(seq, TokenChunk(request_id=seq.request_id, index=0, finish_reason=FinishReason.ABORT,
                                                instance_id=w.instance_id,
                                                error=ErrorInfo(code=ErrorCode.NO_CAPACITY, message=str(e))))  # fmt: skip
            await w.host.run(w.engine.cache.free, seq)
            return
        self.num_prefilled += 1
        seq.append_token(token)
        reason = check_finish(seq, w.eos_ids, w.engine.max_model_len)
        if seq.request_id in w.cancelled:
            await w.host.run(w.engine.cache.free, seq)
            return
        await self._publish(seq, TokenChunk(
            request_id=seq.request_id, index=0, token_ids=[token], finish_reason=reason.value if reason else None,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens, instance_id=w.instance_id,
        ))  # fmt: skip
        if reason is not None:
            await w.host.run(w.engine.cache.free, seq)
            return
        w.running.append(seq)  # from here on it is one of the batch
        w._work.set()

    def _compute(self, seq: Sequence) -> int:
        """Engine thread, between two decode steps: prefill and sample the first token."""
        engine = self.worker.engine
        engine.cache.match_prefix(seq)
        engine.cache.allocate(seq, seq.num_tokens)
        logits = engine.prefill([seq])
        return sample(logits, [seq.params], [0])[0]

    async def _publish(self, seq: Sequence, chunk: TokenChunk) -> None:
        await self.worker.publish(subjects.tokens(seq.request_id), chunk)

    def fill(self, beat: DecodeBeat) -> None:
        w = self.worker
        beat.cost = self.cost
        beat.batch_size = len(w.running) + len(w.waiting)
        beat.context_tokens = sum(s.num_tokens for s in w.running)
