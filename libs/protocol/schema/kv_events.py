"""KV events: what each holder of KV blocks (prefill workers' caches, stores) publishes,
and snapshots for a conductor that (re)starts."""

import msgspec

from libs.protocol.hashing import BlockHash
from libs.protocol.ids import InstanceId
from libs.protocol.schema.codec import Message
from libs.protocol.vocabulary import KVEventKind, KVTier


class KVEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One change to what a publisher holds, numbered ``seq`` (1, 2, ... per epoch).

    stored: now held in ``tier``. evicted / removed: no longer held in ``tier``
    (for capacity / on purpose or corruption). promoted: copied up into ``tier``
    from the slower ``source_tier``, which keeps it (tiers are inclusive).
    demoted: moved down into ``tier`` from ``source_tier``, which no longer holds
    it. Tiers, fastest first: device, dram, disk.
    """

    seq: int
    kind: KVEventKind
    tier: KVTier
    block_hashes: list[BlockHash]
    source_tier: KVTier | None = None


class KVEventBatch(Message):
    """Consecutive KV events of one publisher. ``epoch`` is random per process
    start: a new epoch means the publisher restarted and its numbering with it."""

    instance_id: InstanceId
    epoch: int
    events: list[KVEvent]


class KVSnapshotRequest(Message):
    instance_id: InstanceId


class KVSnapshotReply(Message):
    """Everything the publisher holds, as of event ``seq`` of ``epoch`` included."""

    instance_id: InstanceId
    epoch: int
    seq: int
    tiers: dict[KVTier, list[BlockHash]] = msgspec.field(default_factory=dict)
