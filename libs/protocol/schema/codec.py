"""The base of every control-plane message and its encoding: msgspec Structs as msgpack,
versioned.

Each message carries the protocol version ``v``; `decode` reads it before
anything else, so a service can tell an older (or newer) peer clearly that it
speaks another version instead of failing on a missing field.
"""

from typing import Any, TypeVar

import msgspec

from libs.protocol.vocabulary import ErrorCode

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
