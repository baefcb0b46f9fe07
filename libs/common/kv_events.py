"""KV events: how a holder of KV blocks tells the conductor exactly what it holds.

Publisher side: `KVEventLog` numbers every change (1, 2, ... within an epoch
that is random per process start), keeps the holder's contents by tier so it
can answer a snapshot consistent with that numbering, and hands out batches;
`KVEventPublisher` flushes those batches on NATS, answers snapshot requests and sends
a checkpoint (a snapshot) now and then for the KV history (libs/common/kv_history.py).
Consumer side: `KVEventTracker` applies each publisher's events in order and,
on a gap (a lost batch, a restart, a silent tail seen in a heartbeat), asks
for a snapshot, buffers what arrives meanwhile, and catches up from it.
Neither side knows what an index is: the tracker calls ``apply`` and ``reset``.
"""

import asyncio
import logging
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from libs.protocol import subjects
from libs.protocol.ids import InstanceId
from libs.protocol.schema import KVEvent, KVEventBatch, KVSnapshotReply, KVSnapshotRequest
from libs.protocol.vocabulary import KVEventKind, KVTier

TIERS = (KVTier.DEVICE, KVTier.DRAM, KVTier.DISK)  # fastest first
_ADDS = (KVEventKind.STORED, KVEventKind.PROMOTED, KVEventKind.DEMOTED)  # kinds after which the blocks are in `tier`
MAX_BATCH_EVENTS = 256
FLUSH_DELAY = 0.005  # seconds a flush waits for more events to join the batch
CHECKPOINT_S = 30.0  # how often a publisher sends its whole contents to the KV history (kv_history.py)

log = logging.getLogger(__name__)


class KVEventLog:
    """Thread-safe: `record` may be called from any thread (a worker's engine thread)."""

    def __init__(self, instance_id: InstanceId, epoch: int | None = None, tiers: Sequence[str] = TIERS) -> None:
        """``tiers``: the names whose holdings it keeps (every tier its owner records)."""
        self.instance_id = instance_id
        self.epoch = epoch if epoch is not None else secrets.randbits(62) + 1
        self._lock = threading.Lock()
        self._seq = 0
        self._published_seq = 0
        self._holdings: dict[str, set[bytes]] = {tier: set() for tier in tiers}
        self._pending: list[KVEvent] = []
        self.on_pending: Callable[[], None] | None = None  # called (under no lock) when a batch starts

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def published_seq(self) -> int:
        """The last sequence number handed out in a batch."""
        return self._published_seq

    def record(
        self, kind: KVEventKind, tier: KVTier, hashes: Iterable[bytes], source_tier: KVTier | None = None
    ) -> KVEvent | None:
        """Apply one change; only blocks whose state really changes are in the event.
        Returns the event, or None when nothing changed."""
        with self._lock:
            held = self._holdings[tier]
            if kind in _ADDS:
                changed = [h for h in dict.fromkeys(hashes) if h not in held]
                held.update(changed)
                if kind == KVEventKind.DEMOTED:  # a move down: the blocks leave their source tier
                    self._holdings[source_tier].difference_update(changed)
            else:
                changed = [h for h in dict.fromkeys(hashes) if h in held]
                held.difference_update(changed)
            if not changed:
                return None
            self._seq += 1
            event = KVEvent(seq=self._seq, kind=kind, tier=tier, block_hashes=changed, source_tier=source_tier)
            self._pending.append(event)
            first = len(self._pending) == 1
        if first and self.on_pending is not None:
            self.on_pending()
        return event

    def take_batch(self, max_events: int = MAX_BATCH_EVENTS) -> KVEventBatch | None:
        with self._lock:
            if not self._pending:
                return None
            events, self._pending = self._pending[:max_events], self._pending[max_events:]
            self._published_seq = events[-1].seq
        return KVEventBatch(instance_id=self.instance_id, epoch=self.epoch, events=events)

    def snapshot(self) -> KVSnapshotReply:
        with self._lock:
            tiers = {tier: list(held) for tier, held in self._holdings.items() if held}
            return KVSnapshotReply(instance_id=self.instance_id, epoch=self.epoch, seq=self._seq, tiers=tiers)

    def contents(self, tier: str) -> set[bytes]:
        with self._lock:
            return set(self._holdings[tier])


class KVEventPublisher:
    """Flushes a `KVEventLog` on the instance's event subject and answers its
    snapshot subject. ``service`` is a libs.common.service.Service."""

    def __init__(self, service, events: KVEventLog) -> None:
        self.service = service
        self.events = events
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, stack) -> None:
        self._loop = asyncio.get_running_loop()
        self.events.on_pending = self._signal
        subject = subjects.kv_snapshot(self.events.instance_id)
        await self.service.subscribe(subject, KVSnapshotRequest, self._on_snapshot)
        task = self.service.spawn(self._flush_loop())
        stack.callback(task.cancel)
        checkpoints = self.service.spawn(self._checkpoint_loop())
        stack.callback(checkpoints.cancel)
        self._wake.set()  # whatever was recorded before start

    def _signal(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _flush_loop(self) -> None:
        subject = subjects.kv_events(self.events.instance_id)
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(FLUSH_DELAY)  # let the rest of this burst join the batch
            while (batch := self.events.take_batch()) is not None:
                try:
                    await self.service.publish(subject, batch)
                except Exception as e:  # the consumer sees the gap and asks for a snapshot
                    log.warning("KV events %d..%d not sent: %s", batch.events[0].seq, batch.events[-1].seq, e)

    async def _checkpoint_loop(self) -> None:
        """Its whole contents every CHECKPOINT_S seconds, the first at once, for JetStream to
        keep for a conductor that starts (libs/common/kv_history.py). Sent even when nothing
        changed: a checkpoint that ages out means a publisher gone."""
        subject = subjects.kv_checkpoint(self.events.instance_id)
        while True:
            try:
                await self.service.publish(subject, self.events.snapshot())
            except Exception as e:  # a starting conductor then asks for a snapshot instead
                log.warning("KV checkpoint not sent: %s", e)
            await asyncio.sleep(CHECKPOINT_S)

    async def _on_snapshot(self, request: KVSnapshotRequest, msg: Msg) -> KVSnapshotReply:
        return self.events.snapshot()


# --- consumer side ---------------------------------------------------------------------
Apply = Callable[[str, KVEvent], None]  # (instance id, event)
Reset = Callable[[str, dict[str, list[bytes]]], None]  # (instance id, contents by tier)


@dataclass
class _Stream:
    epoch: int
    seq: int = 0  # last event applied
    awaiting_snapshot: bool = False
    buffered: list[KVEvent] = field(default_factory=list)
    heard_seq: int = 0  # the last heartbeat's sequence number, when it was ahead of `seq`


class KVEventTracker:
    """Per publisher: apply events in sequence order, exactly once. Each method
    returns True when the caller should request that publisher's snapshot."""

    def __init__(self, apply: Apply, reset: Reset) -> None:
        self._apply = apply
        self._reset = reset
        self._streams: dict[str, _Stream] = {}
        self.gaps = 0  # how many times a snapshot was needed
        self.events_applied = 0

    def stream_position(self, instance_id: InstanceId) -> tuple[int, int] | None:
        """(epoch, last sequence number applied) for a publisher, if known."""
        s = self._streams.get(instance_id)
        return None if s is None else (s.epoch, s.seq)

    def on_batch(self, batch: KVEventBatch) -> bool:
        stream = self._streams.get(batch.instance_id)
        if stream is None or stream.epoch != batch.epoch:
            stream = self._restart(batch.instance_id, batch.epoch)
        if stream.awaiting_snapshot:
            stream.buffered.extend(batch.events)
            return False
        return self._apply_in_order(batch.instance_id, stream, batch.events)

    def on_heartbeat(self, instance_id: InstanceId, epoch: int, seq: int) -> bool:
        """A publisher's heartbeat names its last published event. Events still missing
        at the next heartbeat (the lost tail of a stream, or everything since a restart)
        mean a snapshot; one heartbeat of grace, since a heartbeat may be handled before
        the batch published just ahead of it."""
        if epoch == 0:
            return False  # publishes no KV events
        stream = self._streams.get(instance_id)
        if stream is None or stream.epoch != epoch:
            stream = self._restart(instance_id, epoch)
        missing = stream.heard_seq > stream.seq
        stream.heard_seq = seq
        if stream.awaiting_snapshot or not missing or seq <= stream.seq:
            return False
        return self._need_snapshot(stream)

    def on_snapshot(self, reply: KVSnapshotReply) -> bool:
        stream = self._streams.get(reply.instance_id)
        if stream is None or stream.epoch != reply.epoch:  # restarted since we asked
            stream = self._streams[reply.instance_id] = _Stream(epoch=reply.epoch)
        self._reset(reply.instance_id, reply.tiers)
        stream.seq, stream.awaiting_snapshot = reply.seq, False
        buffered, stream.buffered = stream.buffered, []
        return self._apply_in_order(reply.instance_id, stream, sorted(buffered, key=lambda e: e.seq))

    def snapshot_failed(self, instance_id: InstanceId) -> None:
        """The snapshot request went unanswered: ask again at the next sign of a gap."""
        stream = self._streams.get(instance_id)
        if stream is not None:
            stream.awaiting_snapshot = False

    def forget(self, instance_id: InstanceId) -> None:
        if self._streams.pop(instance_id, None) is not None:
            self._reset(instance_id, {})

    def _restart(self, instance_id: InstanceId, epoch: int) -> _Stream:
        """A publisher seen for the first time, or restarted: it starts from nothing."""
        if instance_id in self._streams:
            self._reset(instance_id, {})
        stream = self._streams[instance_id] = _Stream(epoch=epoch)
        return stream

    def _apply_in_order(self, instance_id: InstanceId, stream: _Stream, events: list[KVEvent]) -> bool:
        for i, event in enumerate(events):
            if event.seq <= stream.seq:
                continue  # already applied (or covered by the snapshot)
            if event.seq != stream.seq + 1:
                stream.buffered = list(events[i:])
                return self._need_snapshot(stream)
            self._apply(instance_id, event)
            self.events_applied += 1
            stream.seq = event.seq
        return False

    def _need_snapshot(self, stream: _Stream) -> bool:
        stream.awaiting_snapshot = True
        self.gaps += 1
        return True
