"""KV history in JetStream: what a conductor that starts (or restarts) reads to learn
every publisher's KV contents, instead of asking each one for a snapshot at once.

Two streams, in memory and bounded (`ensure_streams`; a conductor makes them), each
replicated on three servers where NATS is a cluster of three or more (`replicas_for`), so
the history outlives any one nats-server:
- ``KVSERVE_KV_CHECKPOINTS`` keeps the last checkpoint of each publisher: its whole
  contents as of one of its event numbers (a `KVSnapshotReply`), which `KVEventPublisher`
  publishes every `CHECKPOINT_S` seconds; one a publisher stopped sending ages out.
- ``KVSERVE_KV_EVENTS`` keeps the KV event batches of the last `EVENTS_MAX_AGE_S`
  seconds, longer than a checkpoint's period, so the events after any live publisher's
  last checkpoint are all there.

`replay` reads the checkpoints, then the events stored since the oldest of them, through
consumers of its own that it deletes when done, and hands them to a `KVEventTracker`
(libs/common/kv_events.py) in that order: each publisher's contents as of its
checkpoint, then its later events.
What the history cannot give (a publisher whose checkpoint aged out, events lost to
retention) is a gap the tracker sees, and that publisher alone is asked for a snapshot.
"""

import datetime
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from libs.common.kv_events import CHECKPOINT_S
from libs.protocol import subjects
from libs.protocol.schema import BadMessageError, KVEventBatch, KVSnapshotReply, decode

CHECKPOINTS_MAX_AGE_S = 3 * CHECKPOINT_S  # a publisher silent this long is gone; so is its checkpoint
EVENTS_MAX_AGE_S = 4 * CHECKPOINT_S
CHECKPOINTS_MAX_BYTES = 256 << 20
EVENTS_MAX_BYTES = 128 << 20
START_SLACK = datetime.timedelta(seconds=1)  # events read from this long before the oldest checkpoint
FETCH_BATCH = 512
FETCH_TIMEOUT_S = 2.0


REPLICAS = 3  # JetStream's usual replication: a majority of 3 survives one server lost


def replicas_for(nc: Client) -> int:
    """How many servers keep each stream: ``REPLICAS`` where the client knows of that many
    nats-servers (those it was given and those the cluster told it of), else 1."""
    return REPLICAS if len(nc.servers) >= REPLICAS else 1


def stream_configs(replicas: int = 1) -> list[StreamConfig]:
    common = dict(storage=StorageType.MEMORY, discard=DiscardPolicy.OLD, num_replicas=replicas)
    return [
        StreamConfig(name=subjects.KV_CHECKPOINTS_STREAM, subjects=[subjects.KV_CHECKPOINT_ALL],
                     max_msgs_per_subject=1, max_age=CHECKPOINTS_MAX_AGE_S, max_bytes=CHECKPOINTS_MAX_BYTES, **common),
        StreamConfig(name=subjects.KV_EVENTS_STREAM, subjects=[subjects.KV_EVENTS_ALL],
                     max_age=EVENTS_MAX_AGE_S, max_bytes=EVENTS_MAX_BYTES, **common),
    ]  # fmt: skip


async def ensure_streams(js: JetStreamContext, replicas: int = 1) -> None:
    """Make the two streams, or bring an existing one to this configuration (its replicas
    included). Raises what JetStream raises when it cannot (not enabled on this NATS, not
    ready yet, fewer servers than ``replicas``)."""
    for config in stream_configs(replicas):
        try:
            await js.stream_info(config.name)
        except NotFoundError:
            await js.add_stream(config)
        else:
            await js.update_stream(config)


@dataclass
class ReplayStats:
    checkpoints: int = 0
    batches: int = 0
    bad: int = 0  # messages that did not decode (logged by the caller, dropped)
    seconds: float = 0.0


async def replay(
    js: JetStreamContext,
    on_checkpoint: Callable[[KVSnapshotReply], None],
    on_batch: Callable[[KVEventBatch], None],
) -> ReplayStats:
    """Read every retained checkpoint, then every retained event batch, in stream order,
    each handed to its callback; return once both streams are read to their end as of the
    call. Raises what JetStream raises (no such stream, not reachable)."""
    stats = ReplayStats()
    started = time.monotonic()

    oldest: datetime.datetime | None = None  # when the oldest checkpoint read was stored

    def checkpoint(msg: Msg) -> None:
        nonlocal oldest
        on_checkpoint(decode(msg.data, KVSnapshotReply))
        stats.checkpoints += 1
        stamp = msg.metadata.timestamp
        oldest = stamp if oldest is None else min(oldest, stamp)

    def batch(msg: Msg) -> None:
        on_batch(decode(msg.data, KVEventBatch))
        stats.batches += 1

    await _read(js, subjects.KV_CHECKPOINTS_STREAM, subjects.KV_CHECKPOINT_ALL,
                ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT), checkpoint, stats)  # fmt: skip
    # Events stored before the oldest checkpoint are in every checkpoint already (a publisher
    # sends its events after the checkpoint that counts them): not read. A publisher with no
    # checkpoint there lost its first ones anyway (a gap, so a snapshot).
    since = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    if oldest is not None:
        since = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=oldest - START_SLACK)
    await _read(js, subjects.KV_EVENTS_STREAM, subjects.KV_EVENTS_ALL, since, batch, stats)
    stats.seconds = time.monotonic() - started
    return stats


async def _read(js: JetStreamContext, stream: str, subject: str, config: ConsumerConfig,
                handle: Callable[[Msg], None], stats: ReplayStats) -> None:  # fmt: skip
    """The messages of ``stream`` that ``config`` delivers, up to its last one now, through a
    pull consumer of its own."""
    last = (await js.stream_info(stream)).state.last_seq
    if not last:
        return
    name = f"kvserve-replay-{secrets.token_hex(6)}"
    config.name, config.filter_subject, config.ack_policy = name, subject, AckPolicy.NONE
    config.inactive_threshold, config.mem_storage = 30.0, True
    await js.add_consumer(stream, config=config)
    subscription = await js.pull_subscribe_bind(name, stream=stream)
    try:
        while True:
            try:
                messages = await subscription.fetch(FETCH_BATCH, timeout=FETCH_TIMEOUT_S)
            except TimeoutError:
                return  # what was left aged out meanwhile
            for msg in messages:
                try:
                    handle(msg)
                except BadMessageError:
                    stats.bad += 1
            tail = messages[-1].metadata
            if tail.num_pending == 0 or tail.sequence.stream >= last:
                return
    finally:
        await subscription.unsubscribe()
        try:
            await js.delete_consumer(stream, name)
        except Exception:
            pass  # it goes by itself once inactive (inactive_threshold)
