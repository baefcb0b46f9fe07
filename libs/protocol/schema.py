"""Every control-plane message, as msgspec Structs encoded with msgpack.

Each message carries the protocol version ``v``; `decode` reads it before
anything else, so a service can tell an older (or newer) peer clearly that it
speaks another version instead of failing on a missing field. Bulk KV bytes are
never in these messages: they move through the transfer engine.
"""

from typing import Any, Literal, TypeVar

import msgspec

from libs.protocol.hashing import BlockHash
from libs.protocol.ids import BlockId, InstanceId, RequestId
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.vocabulary import ErrorCode, FinishReason, KVEventKind, KVTier, Role, StoreTier

PROTOCOL_VERSION = 1


class BadMessageError(Exception):
    """A message that cannot be decoded as what its subject carries."""


class ProtocolVersionError(BadMessageError):
    """A message from a peer that speaks another protocol version."""


class Message(msgspec.Struct, tag=True, kw_only=True):
    v: int = PROTOCOL_VERSION


class ErrorInfo(msgspec.Struct, kw_only=True):
    """Why a token stream failed, inside its last TokenChunk."""

    code: ErrorCode
    message: str


class ErrorReply(Message):
    """The answer to any request that was refused or failed, in place of its reply:
    every request/reply pair decodes its answer as ``XReply | ErrorReply``
    (`decode_reply`). A service answers a message it cannot decode, and a handler
    that raised, with one too."""

    code: ErrorCode
    message: str
    retry_after_s: float | None = None  # a rejected admission: when the conductor predicts it could be admitted
    reason: str | None = None  # ... and which target it would miss (ttft_slo, tbt_slo, slo_unattainable, ...)
    predicted_ttft_s: float | None = None  # ... and what it predicted for the request now
    predicted_tbt_s: float | None = None


class KVContract(msgspec.Struct, frozen=True, kw_only=True):
    """What two holders of KV blocks must agree on to exchange them byte for byte."""

    model_id: str
    block_size: int
    layout: str  # KVLayout.describe(): shape and dtype of one block
    hash_scheme: str
    quantization: str = "none"  # the weights' precision: KV computed with other weights is other KV

    def mismatch(self, other: "KVContract") -> str | None:
        """None if compatible, else a sentence naming every field that differs."""
        diffs = [
            f"{name} {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]
        return "KV contract mismatch: " + "; ".join(diffs) if diffs else None


class WriteTicket(msgspec.Struct, frozen=True, kw_only=True):
    """A receiver's grant to write into some of its memory, for one transfer.

    Same host: the sender maps ``segment`` (shared memory) and copies. Other host:
    it connects to ``address`` and proves it holds ``token`` (a secret: it never
    crosses the data plane), which the receiver issued for this transfer alone and
    accepts for no other ranges, for each byte once, and no longer than the lease.
    ``address`` is None when the receiver issued it for a writer on its own host.
    A new ticket is needed for every transfer.
    """

    token: str
    host_id: str
    segment: str
    address: str | None = None  # "host:port" of the receiver's TCP listener


class CostCoefficients(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's cost model in seconds, fitted at start-up on its own hardware
    (`libs/engine/cost_model.py` holds the formulas and the calibration).

    prefill(n new tokens after c cached) = base + per_token·n + per_token_context·n·(c + n/2)
    decode step(batch b, total context t) = base + per_seq·b + per_context_token·t
    """

    block_size: int
    prefill_base: float
    prefill_per_token: float
    prefill_per_token_context: float  # per new token per token it attends to
    decode_base: float
    decode_per_seq: float
    decode_per_context_token: float
    transfer_per_block: float  # one KV block copied between shared-memory segments
    load_per_block: dict[StoreTier, float] = msgspec.field(default_factory=dict)  # a store's tiers


# --- membership ------------------------------------------------------------------
class Beat(msgspec.Struct, tag=True, kw_only=True):
    """What one role adds to its heartbeat (a Heartbeat's ``payload``)."""


class GatewayBeat(Beat):
    load: int = 0  # requests in flight


class ConductorBeat(Beat):
    load: int = 0  # requests admitted and not yet finished
    prefills_on_decode: bool = False  # its policy prefills on decode workers when no prefill worker is alive


class KVPoolBeat(Beat):
    """What every holder of a KV pool (prefill and decode workers, stores) publishes."""

    capacity: int = 0  # KV blocks
    free_blocks: int = 0
    segment: str | None = None  # shared-memory segment of the pool; None: not reported (a simulated instance)
    contract: KVContract | None = None
    cost: CostCoefficients | None = None  # its measured cost model, once it has one


class PrefillBeat(KVPoolBeat):
    load: int = 0  # requests running or queued
    queued_tokens: int = 0  # prompt tokens still to compute
    speed: float = 0.0  # its steps' measured time over its cost model's, the median of recent ones; 0: not yet
    chunk_tokens: int = 0  # the most prompt tokens one step computes (a request is cut only between steps); 0: unknown
    # every request it holds: the share of its prefill still to compute (1: not started), so the
    # conductor's picture of its queue is set right at each heartbeat
    progress: dict[str, float] = msgspec.field(default_factory=dict)
    kv_epoch: int = 0  # its KV event stream: the epoch ...
    kv_seq: int = 0  # ... and the last sequence number published


class DecodeBeat(KVPoolBeat):
    load: int = 0  # sequences running or waiting, and leases
    batch_size: int = 0  # sequences running or waiting
    context_tokens: int = 0  # tokens of KV those sequences hold


class StoreBeat(KVPoolBeat):
    kv_epoch: int = 0  # its KV event stream: the epoch ...
    kv_seq: int = 0  # ... and the last sequence number published


ROLE_BEATS: dict[Role, type[Beat]] = {
    Role.GATEWAY: GatewayBeat,
    Role.CONDUCTOR: ConductorBeat,
    Role.PREFILL: PrefillBeat,
    Role.DECODE: DecodeBeat,
    Role.STORE: StoreBeat,
}


class Heartbeat(Message):
    """Who an instance is, and in ``payload`` what its role publishes (None: nothing
    yet). The properties read the payload for any role: 0 or None where the role
    does not publish that."""

    instance_id: InstanceId
    role: Role
    host_id: str
    started_at: float = 0.0
    address: str | None = None  # gateway: its base URL, once it listens
    payload: GatewayBeat | ConductorBeat | PrefillBeat | DecodeBeat | StoreBeat | None = None

    def __post_init__(self) -> None:
        if self.payload is not None and type(self.payload) is not ROLE_BEATS[self.role]:
            raise ValueError(f"a {self.role} heartbeat carrying a {type(self.payload).__name__}")

    @property
    def load(self) -> int:
        """Requests (or sequences) it is running or holds queued."""
        return 0 if self.payload is None or isinstance(self.payload, StoreBeat) else self.payload.load

    @property
    def pool(self) -> KVPoolBeat | None:
        """Its KV pool, for a prefill or decode worker or a store."""
        return self.payload if isinstance(self.payload, KVPoolBeat) else None

    @property
    def capacity(self) -> int:
        return self.pool.capacity if self.pool is not None else 0

    @property
    def free_blocks(self) -> int:
        return self.pool.free_blocks if self.pool is not None else 0

    @property
    def segment(self) -> str | None:
        return self.pool.segment if self.pool is not None else None

    @property
    def contract(self) -> KVContract | None:
        return self.pool.contract if self.pool is not None else None

    @property
    def cost(self) -> CostCoefficients | None:
        return self.pool.cost if self.pool is not None else None

    @property
    def prefills_on_decode(self) -> bool:
        """A conductor whose requests need no prefill worker (its policy has local_prefill)."""
        return isinstance(self.payload, ConductorBeat) and self.payload.prefills_on_decode

    @property
    def prefill_speed(self) -> float:
        """A prefill worker's measured slowness against its cost model; 0: not reported."""
        return self.payload.speed if isinstance(self.payload, PrefillBeat) else 0.0

    @property
    def prefill_progress(self) -> dict[str, float]:
        return self.payload.progress if isinstance(self.payload, PrefillBeat) else {}

    @property
    def chunk_tokens(self) -> int:
        return self.payload.chunk_tokens if isinstance(self.payload, PrefillBeat) else 0

    @property
    def queued_tokens(self) -> int:
        return self.payload.queued_tokens if isinstance(self.payload, PrefillBeat) else 0

    @property
    def batch_size(self) -> int:
        return self.payload.batch_size if isinstance(self.payload, DecodeBeat) else 0

    @property
    def context_tokens(self) -> int:
        return self.payload.context_tokens if isinstance(self.payload, DecodeBeat) else 0

    @property
    def kv_epoch(self) -> int:
        """Its KV event stream's epoch; 0: it publishes no KV events."""
        return self.payload.kv_epoch if isinstance(self.payload, (PrefillBeat, StoreBeat)) else 0

    @property
    def kv_seq(self) -> int:
        return self.payload.kv_seq if isinstance(self.payload, (PrefillBeat, StoreBeat)) else 0


class RollCall(Message):
    """Asks every instance to publish its heartbeat now."""

    instance_id: InstanceId  # who asks (for logs)


class MetricsRequest(Message):
    pass


class MetricsReply(Message):
    text: str  # Prometheus text exposition format


# --- conductor -----------------------------------------------------------------
class AdmitRequest(Message):
    request_id: RequestId
    num_prompt_tokens: int
    max_tokens: int
    block_hashes: list[BlockHash] = msgspec.field(default_factory=list)
    slo_ttft_s: float | None = None  # None: the conductor's default
    slo_tbt_s: float | None = None
    exclude: list[InstanceId] = msgspec.field(default_factory=list)  # instances not to route to (seen dead by the gateway)
    session_id: str | None = None  # a conversation's turns: kept where its KV is unless moving is predicted cheaper
    best_effort: bool = False  # no SLO: served only in time SLO work does not need, never refused as unattainable
    moved: bool = False  # a request continued after its worker was lost: never refused, and no sample for the margins
    tenant: str | None = None  # who sent it (the gateway's tenants file): under overload, shares are by tenant
    tenant_weight: float = 1.0  # its tenant's weight: its share of a contended cluster, relative to the others'


class AdmitReply(Message):
    prefill_id: InstanceId
    decode_id: InstanceId
    prefill_on_decode: bool = False  # conditional disaggregation: the decode worker prefills it itself
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    cached_tokens: dict[KVTier, int] = msgspec.field(default_factory=dict)  # predicted reuse, by tier
    # its prefill is due this long after the admission (its TTFT target, less the conductor's slack for
    # what happens outside the prefill); None: best effort
    prefill_deadline_s: float | None = None


class ConductorAdmission(Message):
    """Conductor replica -> every replica: an admission it made and the load it books
    on its instances, which each peer books into its own view as if it had made it."""

    conductor_id: InstanceId  # the replica that admitted it
    request_id: RequestId
    prefill_id: InstanceId
    decode_id: InstanceId
    work_s: float  # predicted seconds it adds to the prefill queue
    prefill_speed: float  # the prefill instance's learned slowness, already in work_s
    num_prompt_tokens: int
    max_tokens: int
    expected_output_tokens: int
    predicted_ttft_s: float
    predicted_tbt_s: float | None = None
    session_id: str | None = None
    deadline_in_s: float | None = None  # its prefill is due this long after the admission; None: best effort
    moved: bool = False


class RequestProgress(Message):
    """Gateway -> conductor: how an admitted request went, to settle the
    conductor's predictions (queues, decode load) and measure their error."""

    request_id: RequestId
    kind: Literal["first_token", "finished"]
    ttft_s: float | None = None  # first_token: measured from admission
    num_output_tokens: int = 0


# --- KV events (publishers: prefill workers' caches, stores) -----------------------
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


# --- gateway -> prefill -> decode -------------------------------------------------
class PrefillRequest(Message):
    request_id: RequestId
    prompt_token_ids: list[int]
    sampling: SamplingParams
    decode_id: InstanceId  # on a decode worker's own prefill subject: itself
    ttft_budget_s: float | None = None  # its first token is due this long after the worker takes it; None: best effort
    # the prompt's last tokens that an earlier attempt generated (a migrated request): the
    # penalties count them as generated, so they are rebuilt as an undisturbed run has them
    num_prior_output_tokens: int = 0
    hash_root: BlockHash | None = None  # its cache scope's root, where its block chain starts (None: ROOT, the default)


class Ack(Message):
    """Taken, as asked."""


class ResendRequest(Message):
    """Gateway -> the decode worker a request is on: publish its generated tokens from
    ``from_index`` again (a NATS outage lost some; the gateway holds those before it)."""

    request_id: RequestId
    from_index: int


class ReserveRequest(Message):
    request_id: RequestId
    num_tokens: int  # tokens whose KV will be written into the lease
    prefill_id: InstanceId
    contract: KVContract
    host_id: str | None = None  # the prefill's host for shared memory; None: it may write over TCP (the decode listens)


class ReserveReply(Message):
    block_ids: list[BlockId]
    ticket: WriteTicket  # where and how to write the KV into those blocks
    lease_seconds: float


class HandoffRequest(Message):
    """The reserved blocks hold the prompt's KV: decode the rest."""

    request_id: RequestId
    token_ids: list[int]  # prompt, then the first generated token
    num_prompt_tokens: int
    num_cached_tokens: int
    sampling: SamplingParams
    block_ids: list[BlockId]
    num_prior_output_tokens: int = 0  # as in PrefillRequest
    # n > 1: every sequence's first token, by choice (token_ids ends with the first's); the
    # decode worker forks the others from the prompt's blocks and drops those they finish
    first_token_ids: list[int] = msgspec.field(default_factory=list)
    hash_root: BlockHash | None = None  # as the PrefillRequest's


class ReleaseRequest(Message):
    request_id: RequestId


class Cancel(Message):
    request_id: RequestId
    reason: str = "cancelled"


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One generated token's log-probability and its likeliest alternatives'."""

    logprob: float
    top_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)


class TokenChunk(Message):
    request_id: RequestId
    index: int  # position of token_ids[0] among the generated tokens
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked for them
    choice: int = 0  # which of the request's n sequences (an error chunk ends them all)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    instance_id: InstanceId | None = None  # the worker that produced the chunk
    error: ErrorInfo | None = None
    # From the prefill worker: the decode worker the request continues on (its lease's), which
    # the gateway then takes tokens from. A chunk with only this (no tokens) announces a
    # hand-off retried on another decode worker.
    decode_id: InstanceId | None = None


# --- store ----------------------------------------------------------------------
# Each store instance answers on its own subjects (subjects.store_op). Block bytes
# never travel here: a get writes into the caller's WriteTicket, a put hands the
# caller a WriteTicket for fresh slots, and the blocks become visible at commit.
class StoreExistsRequest(Message):
    contract: KVContract
    block_hashes: list[BlockHash]


class StoreExistsReply(Message):
    tiers: list[StoreTier | None]  # per hash: fastest tier, None = absent


class StoreGetRequest(Message):
    """Write every stored block of ``block_hashes`` through ``ticket`` at ``offsets``
    (one per hash) of the caller's segment; each block is ``block_nbytes`` long."""

    contract: KVContract
    block_hashes: list[BlockHash]
    block_nbytes: int
    ticket: WriteTicket
    offsets: list[int]


class StoreGetReply(Message):
    tiers: list[StoreTier | None]  # per hash: where it came from; None = miss


class StorePutRequest(Message):
    """Phase one of a put: which of these blocks does the store lack? Blocks it holds
    already are a no-op (pinned if ``pin``)."""

    contract: KVContract
    block_hashes: list[BlockHash]
    block_nbytes: int
    pin: bool = False  # evicted only when no unpinned block can be
    host_id: str | None = None  # the writer's host for shared memory; None: it may write over TCP (the store listens)


class StorePutReply(Message):
    """Write block ``block_hashes[missing[i]]`` at ``offsets[i]`` through ``ticket``,
    then commit ``put_id`` within ``ttl_s`` seconds; ``no_room``: blocks the store
    could not place (every slot pinned or being read)."""

    put_id: str | None = None  # None: nothing to write (all held already, or no room)
    missing: list[int] = msgspec.field(default_factory=list)
    offsets: list[int] = msgspec.field(default_factory=list)
    ticket: WriteTicket | None = None
    ttl_s: float = 0.0
    no_room: list[int] = msgspec.field(default_factory=list)


class StoreCommitRequest(Message):
    """Phase two of a put: the bytes are written; make the blocks visible."""

    contract: KVContract
    put_id: str


class StoreCommitReply(Message):
    num_stored: int


class StoreRemoveRequest(Message):
    contract: KVContract
    block_hashes: list[BlockHash]


class StoreRemoveReply(Message):
    num_removed: int  # blocks that were held in some tier


class StoreStatsRequest(Message):
    contract: KVContract


class StoreStatsReply(Message):
    instance_id: InstanceId
    block_nbytes: int
    dram_slots: int
    dram_blocks: int
    dram_pinned: int
    dram_leased: int
    disk_blocks: int
    disk_bytes: int
    disk_capacity_bytes: int
    disk_pending: int  # blocks in DRAM the write-behind has not put on disk yet
    counters: dict[str, int]  # hits, misses, puts, evictions, corruptions...
    kv_epoch: int
    kv_seq: int


# --- the console: a conductor's view, for the gateway's /console ----------------------
class ConductorViewRequest(Message):
    max_decisions: int = 50  # the most recent routing decisions, newest first
    max_prefixes: int = 10  # the hottest reused prefixes


class CandidateView(msgspec.Struct, kw_only=True):
    """One instance a decision weighed, with what was predicted for the request there."""

    instance_id: InstanceId
    role: Role
    predicted_ttft_s: float | None = None  # a prefill candidate: queue + load + compute + hand-off
    queue_s: float | None = None
    cached_tokens: int = 0  # a prefill candidate: prompt tokens it would reuse
    predicted_tbt_s: float | None = None  # a decode candidate: its step time with the request added
    batch_size: int = 0


class DecisionView(msgspec.Struct, kw_only=True):
    """One admission: the pair chosen (or the rejection and why) and every candidate."""

    request_id: RequestId
    at: float  # wall-clock seconds
    policy: str
    prefill_id: InstanceId | None = None
    decode_id: InstanceId | None = None
    prefill_on_decode: bool = False
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    cached_tokens: dict[KVTier, int] = msgspec.field(default_factory=dict)
    candidates: list[CandidateView] = msgspec.field(default_factory=list)
    rejected: str | None = None  # the error code or rejection reason
    why: str | None = None  # the rejection's explanation
    affinity: str | None = None  # a session's turn: whether it stayed where its last turn ran, and why


class PrefixView(msgspec.Struct, kw_only=True):
    """A reused prompt prefix (named by its last block's hash) and where its copies are."""

    block_hash: str  # hex
    num_blocks: int
    hits: int  # admissions that found it held somewhere
    holders: dict[InstanceId, KVTier] = msgspec.field(default_factory=dict)  # fastest tier of its last block


class LearnedView(msgspec.Struct, kw_only=True):
    """What a conductor has learned of its predictions' errors (`services/conductor/margin.py`)."""

    ttft_slack_s: dict[str, float] = msgspec.field(default_factory=dict)  # per prompt-size band, seconds added
    tbt_margins: dict[InstanceId, float] = msgspec.field(default_factory=dict)  # per decode instance, a factor
    prefill_speeds: dict[InstanceId, float] = msgspec.field(default_factory=dict)  # per prefill instance, measured


class ConductorViewReply(Message):
    instance_id: InstanceId
    policy: str
    slo_ttft_s: float
    slo_tbt_s: float
    learned: LearnedView = msgspec.field(default_factory=LearnedView)
    blocks: dict[InstanceId, dict[KVTier, int]] = msgspec.field(default_factory=dict)  # the KV index, counted
    hot_prefixes: list[PrefixView] = msgspec.field(default_factory=list)
    decisions: list[DecisionView] = msgspec.field(default_factory=list)


# --- encoding ----------------------------------------------------------------------
class _Envelope(msgspec.Struct):
    v: int = -1


_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(_Envelope)
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}
M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, kind: type[M]) -> M:
    """Decode ``data`` as ``kind``; raise BadMessageError saying why it cannot be."""
    return _decode(data, kind, kind.__name__)


def decode_reply(data: bytes, kind: type[M]) -> M | ErrorReply:
    """Decode the answer to a request whose reply is ``kind``: that reply, or the
    ErrorReply of a peer that refused or failed the request; raise BadMessageError
    when it is neither."""
    return _decode(data, kind | ErrorReply, f"{kind.__name__} or ErrorReply")


def _decode(data: bytes, kind: Any, name: str) -> Any:
    try:
        version = _envelope.decode(data).v
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadMessageError(f"not a kvserve message ({e})") from e
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"{name} from a peer speaking protocol v{version}; this service speaks v{PROTOCOL_VERSION}"
        )
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadMessageError(f"bad {name}: {e}") from e


def to_builtins(message: Message) -> dict[str, Any]:
    return msgspec.to_builtins(message)
