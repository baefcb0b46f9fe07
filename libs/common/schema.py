"""Every control-plane message, as msgspec Structs encoded with msgpack.

Each message carries the protocol version ``v``; `decode` reads it before
anything else, so a service can tell an older (or newer) peer clearly that it
speaks another version instead of failing on a missing field. Bulk KV bytes are
never in these messages: they move through the transfer engine.
"""

from typing import Any, TypeVar

import msgspec

from libs.common.model.sampling_params import SamplingParams

PROTOCOL_VERSION = 1


class BadMessageError(Exception):
    """A message that cannot be decoded as what its subject carries."""


class ProtocolVersionError(BadMessageError):
    """A message from a peer that speaks another protocol version."""


class Message(msgspec.Struct, tag=True, kw_only=True):
    v: int = PROTOCOL_VERSION


class ErrorInfo(msgspec.Struct, kw_only=True):
    code: str  # no_prefill, no_decode, no_capacity, invalid_request, contract_mismatch, internal, ...
    message: str


class KVContract(msgspec.Struct, frozen=True, kw_only=True):
    """What two holders of KV blocks must agree on to exchange them byte for byte."""

    model_id: str
    block_size: int
    layout: str  # KVLayout.describe(): shape and dtype of one block
    hash_scheme: str

    def mismatch(self, other: "KVContract") -> str | None:
        """None if compatible, else a sentence naming every field that differs."""
        diffs = [
            f"{name} {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]
        return "KV contract mismatch: " + "; ".join(diffs) if diffs else None


# --- membership ------------------------------------------------------------------
class Heartbeat(Message):
    instance_id: str
    role: str  # gateway, conductor, prefill, decode, store
    host_id: str
    address: str = ""  # gateway: its base URL
    load: int = 0  # requests running or queued
    capacity: int = 0  # KV blocks (workers, store)
    free_blocks: int = 0
    segment: str | None = None  # shared-memory segment of its KV pool
    contract: KVContract | None = None
    started_at: float = 0.0


# --- conductor -----------------------------------------------------------------
class AdmitRequest(Message):
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    block_hashes: list[bytes] = msgspec.field(default_factory=list)


class AdmitReply(Message):
    prefill_id: str | None = None
    decode_id: str | None = None
    error: ErrorInfo | None = None


# --- gateway -> prefill -> decode -------------------------------------------------
class PrefillRequest(Message):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    decode_id: str


class Ack(Message):
    error: ErrorInfo | None = None


class ReserveRequest(Message):
    request_id: str
    num_tokens: int  # tokens whose KV will be written into the lease
    prefill_id: str
    contract: KVContract


class ReserveReply(Message):
    block_ids: list[int] = msgspec.field(default_factory=list)
    segment: str = ""
    lease_seconds: float = 0.0
    error: ErrorInfo | None = None


class HandoffRequest(Message):
    """The reserved blocks hold the prompt's KV: decode the rest."""

    request_id: str
    token_ids: list[int]  # prompt, then the first generated token
    num_prompt_tokens: int
    num_cached_tokens: int
    sampling: SamplingParams
    block_ids: list[int]


class ReleaseRequest(Message):
    request_id: str


class Cancel(Message):
    request_id: str
    reason: str = "cancelled"


class TokenChunk(Message):
    request_id: str
    index: int  # position of token_ids[0] among the generated tokens
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: str | None = None  # stop, length, abort
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    instance_id: str = ""
    error: ErrorInfo | None = None


# --- store ----------------------------------------------------------------------
class StoreExistsRequest(Message):
    contract: KVContract
    block_hashes: list[bytes]


class StoreExistsReply(Message):
    present: list[bool] = msgspec.field(default_factory=list)
    error: ErrorInfo | None = None


class StoreGetRequest(Message):
    """Copy the longest stored prefix of ``block_hashes`` into ``segment`` at ``offsets``."""

    contract: KVContract
    block_hashes: list[bytes]
    segment: str
    offsets: list[int]


class StoreGetReply(Message):
    num_found: int = 0
    error: ErrorInfo | None = None


class StorePutRequest(Message):
    """Copy blocks from ``segment`` at ``offsets`` into the store under ``block_hashes``."""

    contract: KVContract
    block_hashes: list[bytes]
    segment: str
    offsets: list[int]


class StorePutReply(Message):
    num_stored: int = 0
    error: ErrorInfo | None = None


# --- encoding ----------------------------------------------------------------------
class _Envelope(msgspec.Struct):
    v: int = -1


_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(_Envelope)
_decoders: dict[type, msgspec.msgpack.Decoder] = {}
M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, kind: type[M]) -> M:
    """Decode ``data`` as ``kind``; raise BadMessageError saying why it cannot be."""
    try:
        version = _envelope.decode(data).v
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadMessageError(f"not a kvserve message ({e})") from e
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"{kind.__name__} from a peer speaking protocol v{version}; this service speaks v{PROTOCOL_VERSION}"
        )
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadMessageError(f"bad {kind.__name__}: {e}") from e


def to_builtins(message: Message) -> dict[str, Any]:
    return msgspec.to_builtins(message)
