"""Membership: heartbeats with each role's payload, roll calls, metrics requests."""

import msgspec

from libs.protocol.ids import InstanceId
from libs.protocol.schema.codec import Message
from libs.protocol.schema.contracts import CostCoefficients, KVContract
from libs.protocol.vocabulary import Role


class Beat(msgspec.Struct, tag=True, kw_only=True):
    """What one role adds to its heartbeat (a Heartbeat's ``payload``)."""


class GatewayBeat(Beat):
    load: int = 0  # requests in flight


class ConductorBeat(Beat):
    load: int = 0  # requests admitted and not yet finished
    prefills_on_decode: bool = False  # decode workers prefill when no prefill worker is alive (or ever was)


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
    chunk_tokens: int = 0  # the most prompt tokens it prefills between two decode steps; 0: unknown


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
    # start-up work still shares its cores (a worker's grammar tables): what it runs now is slower
    # than it will be, so the conductor learns no speed or margin from it
    warming: bool = False
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
        """A conductor whose requests need no prefill worker (local_prefill, or a colocated cluster)."""
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
        return self.payload.chunk_tokens if isinstance(self.payload, PrefillBeat | DecodeBeat) else 0

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
