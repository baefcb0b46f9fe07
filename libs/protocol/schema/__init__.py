"""Every control-plane message, as msgspec Structs encoded with msgpack, one module per
kind: the base and its encoding (codec), what KV holders agree on (contracts),
membership, admission, KV events, a request's path (requests), the store's operations,
the console. Services import them from here (``from libs.protocol import schema``, then
``schema.PrefillRequest``). Bulk KV bytes are never in these messages: they move through
the transfer engine.
"""

from libs.protocol.schema.codec import (  # noqa: F401
    BadMessageError,
    ProtocolVersionError,
    Message,
    ErrorInfo,
    ErrorReply,
    encode,
    decode,
    decode_reply,
    to_builtins,
    PROTOCOL_VERSION,
)
from libs.protocol.schema.contracts import (  # noqa: F401
    KVContract,
    WriteTicket,
    CostCoefficients,
)
from libs.protocol.schema.membership import (  # noqa: F401
    ROLE_BEATS,
    Beat,
    GatewayBeat,
    ConductorBeat,
    KVPoolBeat,
    PrefillBeat,
    DecodeBeat,
    StoreBeat,
    Heartbeat,
    RollCall,
    MetricsRequest,
    MetricsReply,
)
from libs.protocol.schema.admission import (  # noqa: F401
    AdmitRequest,
    AdmitReply,
    ConductorAdmission,
    RequestProgress,
)
from libs.protocol.schema.kv_events import (  # noqa: F401
    KVEvent,
    KVEventBatch,
    KVSnapshotRequest,
    KVSnapshotReply,
)
from libs.protocol.schema.requests import (  # noqa: F401
    PrefillRequest,
    Ack,
    ResendRequest,
    ReserveRequest,
    ReserveReply,
    HandoffRequest,
    ReleaseRequest,
    Cancel,
    TokenLogprobs,
    TokenChunk,
)
from libs.protocol.schema.store import (  # noqa: F401
    StoreExistsRequest,
    StoreExistsReply,
    StoreGetRequest,
    StoreGetReply,
    StorePutRequest,
    StorePutReply,
    StoreCommitRequest,
    StoreCommitReply,
    StoreRemoveRequest,
    StoreRemoveReply,
    StoreStatsRequest,
    StoreStatsReply,
)
from libs.protocol.schema.console import (  # noqa: F401
    ConductorViewRequest,
    CandidateView,
    DecisionView,
    PrefixView,
    LearnedView,
    ConductorViewReply,
)
