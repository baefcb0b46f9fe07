"""Conditional disaggregation: the decode worker prefills a request itself, when
the conductor predicts that is faster than a prefill worker plus the hand-off
and its batch can afford the stall, then decodes it in its batch like any
handed-over request. The batch's scheduler prefills such requests a chunk of at
most ``local_chunk_tokens`` between two decode steps (so no token of the batch
waits more than one chunk), in deadline order (shortest first unless an earlier
one would miss its deadline: `libs/common/prefill_order.py`), as a prefill
worker does; the chunk size goes out in heartbeats for the conductor's rule. Also calibrates the worker's cost
model at start-up and reports it, with the batch it is running, in heartbeats.
"""

import time

from nats.aio.msg import Msg

from libs.engine.cost_model import CostModel, calibrate_once, uncalibrated_coefficients
from libs.engine.model.scheduler import Due
from libs.engine.model.sequence import Sequence
from libs.engine.prefill_request import sequence_of
from libs.protocol import subjects
from libs.protocol.schema import Ack, CostCoefficients, DecodeBeat, ErrorReply, PrefillRequest
from libs.protocol.vocabulary import ErrorCode


class LocalPrefill:
    def __init__(self, worker, calibrate_at_start: bool) -> None:
        self.worker = worker  # services.decode.worker.DecodeWorker
        self.calibrate_at_start = calibrate_at_start
        self.cost: CostCoefficients | None = None

    async def start(self, stack) -> None:
        w = self.worker
        if self.calibrate_at_start:
            self.cost = await w.host.run(calibrate_once, w.engine, w.settings.model.calibration_file)
            w.log.info("cost model: %s", CostModel(self.cost).describe())
        await w.subscribe(subjects.decode_prefill(w.instance_id), PrefillRequest, self.on_prefill)

    async def on_prefill(self, request: PrefillRequest, msg: Msg) -> Ack | ErrorReply:
        engine = self.worker.engine
        seq = await sequence_of(engine, request)
        if isinstance(seq, ErrorReply):
            return seq
        if not engine.cache.can_allocate(seq, seq.num_tokens + engine.block_size):
            return ErrorReply(code=ErrorCode.NO_CAPACITY, message=f"{self.worker.instance_id} has no free KV blocks")
        now = time.monotonic()  # the scheduler's clock
        due = Due(None if request.ttft_budget_s is None else now + request.ttft_budget_s, now)
        self.worker.spawn(self.worker.admit(seq, computed=False, due=due))
        return Ack()

    def prefill_time(self, seq: Sequence) -> float:
        """Engine thread: predicted seconds of prefill ``seq`` has left, by the calibrated cost model."""
        cost = CostModel(self.cost or uncalibrated_coefficients(self.worker.engine.block_size))
        return cost.prefill_time(seq.num_tokens - seq.num_computed_tokens, seq.num_computed_tokens)

    def fill(self, beat: DecodeBeat) -> None:
        w = self.worker
        beat.cost = self.cost
        beat.chunk_tokens = w.settings.local_chunk_tokens
        beat.batch_size = w.scheduler.num_requests
        beat.context_tokens = sum(s.num_tokens for s in w.scheduler.running)
