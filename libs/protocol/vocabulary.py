"""The closed sets of words kvserve's messages use: error codes, roles, KV tiers,
finish reasons and KV event kinds, each spelled once.

Every set is a `StrEnum`: msgspec encodes a member as its value, so the wire
carries the same strings as plain text would, and a member compares equal to its
string. A message field typed with one of these rejects any other word on decode.
"""

from enum import StrEnum
from typing import Literal


class ErrorCode(StrEnum):
    """Why a request failed, in an `ErrorReply` or a token chunk's `ErrorInfo`."""

    # the request itself
    INVALID_REQUEST = "invalid_request"
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # the conductor predicts its latency targets cannot be met now
    # routing and capacity
    NO_CONDUCTOR = "no_conductor"  # no conductor replica answered the admission
    NO_INSTANCES = "no_instances"  # no prefill and no decode instance is alive
    NO_PREFILL = "no_prefill"
    NO_DECODE = "no_decode"
    NO_CAPACITY = "no_capacity"  # too few free KV blocks
    NO_LEASE = "no_lease"  # a hand-off for blocks the decode worker no longer reserves
    UNKNOWN_REQUEST = "unknown_request"  # a resend for a request the decode worker neither holds nor just finished
    DECODE_UNAVAILABLE = "decode_unavailable"  # the chosen decode worker did not answer
    CONTRACT_MISMATCH = "contract_mismatch"  # the two sides disagree on the KV contract
    # the store
    UNKNOWN_OP = "unknown_op"
    BAD_BLOCK_SIZE = "bad_block_size"
    UNKNOWN_PUT = "unknown_put"
    # any service
    BAD_MESSAGE = "bad_message"
    INTERNAL = "internal"
    # a failed transfer, by the transfer engine's cause (`libs/transfer`)
    TIMEOUT = "timeout"
    PEER_GONE = "peer_gone"
    BAD_TOKEN = "bad_token"
    BAD_RANGE = "bad_range"
    TRUNCATED = "truncated"
    TLS = "tls"  # the data plane's TLS failed: a certificate the CA did not sign, or TLS on one side only


class Role(StrEnum):
    """What a service instance is; also the token in its NATS subjects."""

    GATEWAY = "gateway"
    CONDUCTOR = "conductor"
    PREFILL = "prefill"
    DECODE = "decode"
    STORE = "store"


class KVTier(StrEnum):
    """Where KV blocks are held, fastest first; ``PEER`` is no holder's tier but a
    source of reuse: blocks copied from another instance's device memory."""

    DEVICE = "device"  # a worker's paged KV pool
    PEER = "peer"
    DRAM = "dram"  # a store's shared-memory pool
    DISK = "disk"  # a store's block files


StoreTier = Literal["dram", "disk"]  # the KVTiers a store holds blocks in


class FinishReason(StrEnum):
    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached, or the context window is full
    ABORT = "abort"  # cancelled by the client or the system


class KVEventKind(StrEnum):
    """What happened to blocks in a holder's tier (see `schema.KVEvent`)."""

    STORED = "stored"
    PROMOTED = "promoted"
    DEMOTED = "demoted"
    EVICTED = "evicted"
    REMOVED = "removed"
