"""What a prefill worker tells the conductor beyond load: every change to its
prefix cache as KV events (device tier), and its cost model, calibrated at
start-up on this machine. The worker calls `start` and `fill` (its heartbeat);
the block pool's listener is set here, so the worker's loop knows nothing of it.
"""

from libs.common.kv_events import KVEventLog, KVEventPublisher
from libs.engine.cost_model import CostModel, calibrate_once
from libs.engine.engine_host import EngineHost
from libs.protocol.hashing import BlockHash
from libs.protocol.schema import CostCoefficients, PrefillBeat
from libs.protocol.vocabulary import KVEventKind, KVTier


class KVReports:
    def __init__(self, service, host: EngineHost, calibrate_at_start: bool, calibration_file: str | None = None) -> None:
        self.service = service
        self.host = host
        self.calibrate_at_start = calibrate_at_start
        self.calibration_file = calibration_file  # where a restart of this instance finds its calibration
        self.events = KVEventLog(service.instance_id)
        self.publisher = KVEventPublisher(service, self.events)
        self.cost: CostCoefficients | None = None
        host.engine.cache.set_listener(self._on_block)  # called on the engine thread

    async def start(self, stack) -> None:
        if self.calibrate_at_start:
            self.cost = await self.host.run(calibrate_once, self.host.engine, self.calibration_file)
            self.service.log.info("cost model: %s", CostModel(self.cost).describe())
        await self.publisher.start(stack)

    def _on_block(self, kind: KVEventKind, block_hash: BlockHash) -> None:
        self.events.record(kind, KVTier.DEVICE, [block_hash])

    def fill(self, beat: PrefillBeat) -> None:
        beat.cost = self.cost
        beat.kv_epoch = self.events.epoch
        beat.kv_seq = self.events.published_seq
