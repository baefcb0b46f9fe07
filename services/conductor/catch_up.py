"""How a conductor that starts learns what every instance holds: from the KV history in
JetStream (libs/common/kv_history.py) when there is one, each instance's last checkpoint
and its events since, so only an instance the history cannot account for is asked for a
snapshot; otherwise, as before, each instance is asked once its heartbeat shows events
this conductor has not seen. KV event batches that arrive while the history is read are
held and applied after it, in order.

It also keeps the history's streams made: a first conductor makes them as soon as
JetStream can (a NATS cluster's JetStream takes seconds to elect a leader), so that the
next conductor to start finds them full.
"""

import asyncio
import logging
from collections.abc import Callable

from nats.aio.client import Client

from libs.common import heap
from libs.common.kv_events import KVEventTracker
from libs.common.kv_history import ReplayStats, ensure_streams, replay, replicas_for
from libs.protocol.ids import InstanceId
from libs.protocol.schema import KVEventBatch, KVSnapshotReply

HISTORY_TIMEOUT_S = 30.0  # reading the history takes longer: ask the instances instead
RETRY_STREAMS_S = 5.0  # JetStream not ready (or not there): try to make the streams again this much later
MAX_RETRIES = 24  # two minutes: a NATS without JetStream is not asked for ever

log = logging.getLogger("kvserve.conductor.catch_up")


class CatchUp:
    """``fetch_snapshot(instance)``: ask one instance for its snapshot (the conductor's)."""

    def __init__(self, tracker: KVEventTracker, fetch_snapshot: Callable[[InstanceId], None],
                 is_alive: Callable[[InstanceId], bool], settle_s: float) -> None:  # fmt: skip
        """``is_alive(instance)``: heard from lately; ``settle_s``: how long after the history
        is read an instance it named must have been heard from, or it is forgotten."""
        self.tracker = tracker
        self.fetch_snapshot = fetch_snapshot
        self.is_alive = is_alive
        self.settle_s = settle_s
        self.catching_up = True  # until the history is read (or found missing)
        self.replayed: set[str] = set()  # instances the history named
        self.stats: ReplayStats | None = None  # what the history gave; None: no history read
        self._held: list[KVEventBatch] = []

    def on_batch(self, batch: KVEventBatch) -> None:
        """A live batch: held while the history is read, applied at once after."""
        if self.catching_up:
            self._held.append(batch)
        elif self.tracker.on_batch(batch):
            self.fetch_snapshot(batch.instance_id)

    async def run(self, nc: Client) -> None:
        """Read the history (once) and then make sure its streams exist (until they do)."""
        js = nc.jetstream()
        try:
            await asyncio.wait_for(ensure_streams(js, replicas_for(nc)), HISTORY_TIMEOUT_S)
            self.stats = await asyncio.wait_for(replay(js, self._on_checkpoint, self._on_replayed), HISTORY_TIMEOUT_S)
        except Exception as e:  # none to read: no JetStream, not ready yet, too slow
            log.info("no KV history to catch up from (%s): instances are asked for snapshots", _why(e))
        else:
            s = self.stats
            log.info("caught up from the KV history in %.2f s: %d checkpoints, %d event batches%s", s.seconds,
                     s.checkpoints, s.batches, f", {s.bad} undecodable dropped" if s.bad else "")  # fmt: skip
        finally:
            self._finish()
        if self.replayed:  # a checkpoint outlives its publisher by up to its max age: forget those gone
            await asyncio.sleep(self.settle_s)
            gone = [i for i in self.replayed if not self.is_alive(i)]
            for instance_id in gone:
                self.tracker.forget(instance_id)
            if gone:
                log.info("forgot the KV of %d instances the history named that are gone", len(gone))
        for _ in range(MAX_RETRIES if self.stats is None else 0):
            await asyncio.sleep(RETRY_STREAMS_S)
            try:
                await asyncio.wait_for(ensure_streams(js, replicas_for(nc)), HISTORY_TIMEOUT_S)
            except Exception:
                continue
            log.info("made the KV history's streams: a conductor that starts from now on catches up from them")
            return

    def _on_checkpoint(self, checkpoint: KVSnapshotReply) -> None:
        self.replayed.add(checkpoint.instance_id)
        if self.tracker.on_snapshot(checkpoint):
            self.fetch_snapshot(checkpoint.instance_id)

    def _on_replayed(self, batch: KVEventBatch) -> None:
        self.replayed.add(batch.instance_id)
        if self.tracker.on_batch(batch):
            self.fetch_snapshot(batch.instance_id)

    def _finish(self) -> None:
        self.catching_up = False
        held, self._held = self._held, []
        for batch in held:
            self.on_batch(batch)
        heap.freeze()  # the index the history built, out of the GC's full passes (libs/common/heap.py)


def _why(e: BaseException) -> str:
    return str(e) or type(e).__name__
