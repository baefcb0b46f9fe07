"""Every control-plane message, as msgspec Structs encoded with msgpack, one module per
kind: the base and its encoding (codec), what KV holders agree on (contracts),
membership, admission, KV events, a request's path (requests), the store's operations,
the console. Services import them from here (``from libs.protocol import schema``, then
``schema.PrefillRequest``). Bulk KV bytes are never in these messages: they move through
the transfer engine.
"""

from libs.protocol.schema.admission import (  # noqa: F401
    AdmitReply,
    AdmitRequest,
    ConductorAdmission,
    RequestProgress,
)
from libs.protocol.schema.codec import (  # noqa: F401
    PROTOCOL_VERSION,
    BadMessageError,
    ErrorInfo,
    ErrorReply,
    Message,
    ProtocolVersionError,
    decode,
    decode_reply,
    encode,
    to_builtins,
)
from libs.protocol.schema.console import (  # noqa: F401
    CandidateView,
    ConductorViewReply,
    ConductorViewRequest,
    DecisionView,
    LearnedView,
    PrefixView,
)
from libs.protocol.schema.contracts import (  # noqa: F401
    CacheOwner,
    CostCoefficients,
    KVContract,
    WriteTicket,
)
from libs.protocol.schema.kv_events import (  # noqa: F401
    KVEvent,
    KVEventBatch,
    KVSnapshotReply,
    KVSnapshotRequest,
)
from libs.protocol.schema.membership import (  # noqa: F401
    ROLE_BEATS,
    Beat,
    ConductorBeat,
    DecodeBeat,
    GatewayBeat,
    Heartbeat,
    KVPoolBeat,
    MetricsReply,
    MetricsRequest,
    PrefillBeat,
    RollCall,
    StoreBeat,
)
from libs.protocol.schema.requests import (  # noqa: F401
    Ack,
    Cancel,
    HandoffRequest,
    PrefillRequest,
    ReleaseRequest,
    ResendRequest,
    ReserveReply,
    ReserveRequest,
    TokenChunk,
    TokenLogprobs,
)
from libs.protocol.schema.store import (  # noqa: F401
    StoreCommitReply,
    StoreCommitRequest,
    StoreExistsReply,
    StoreExistsRequest,
    StoreGetReply,
    StoreGetRequest,
    StorePutReply,
    StorePutRequest,
    StoreRemoveReply,
    StoreRemoveRequest,
    StoreStatsReply,
    StoreStatsRequest,
)
