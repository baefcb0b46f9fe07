"""The wire vocabulary: a reply is its request's reply or an ErrorReply, tagged."""

import msgspec
import pytest

from libs.common import schema
from libs.common.schema import (
    Ack,
    AdmitReply,
    BadMessageError,
    ErrorReply,
    Message,
    ProtocolVersionError,
    StoreCommitReply,
)
from libs.common.vocabulary import ErrorCode


def test_a_reply_decodes_as_itself_or_as_the_error_in_its_place():
    admitted = AdmitReply(prefill_id="prefill-a", decode_id="decode-b", predicted_ttft_s=0.1)
    assert schema.decode_reply(schema.encode(admitted), AdmitReply) == admitted
    rejected = ErrorReply(code=ErrorCode.REJECTED, message="predicted TTFT 4.2 s exceeds 2 s", retry_after_s=2.2,
                          predicted_ttft_s=4.2)  # fmt: skip
    answer = schema.decode_reply(schema.encode(rejected), AdmitReply)
    assert type(answer) is ErrorReply and answer == rejected and answer.code is ErrorCode.REJECTED
    assert type(schema.decode_reply(schema.encode(Ack()), Ack)) is Ack


def test_another_message_in_place_of_a_reply_is_a_bad_message():
    with pytest.raises(BadMessageError, match="bad StoreCommitReply or ErrorReply"):
        schema.decode_reply(schema.encode(Ack()), StoreCommitReply)
    half_admitted = msgspec.msgpack.encode({"type": "AdmitReply", "v": 1, "prefill_id": "prefill-a"})
    with pytest.raises(BadMessageError, match="decode_id"):  # an admission names both workers
        schema.decode_reply(half_admitted, AdmitReply)
    with pytest.raises(BadMessageError, match="not a kvserve message"):
        schema.decode_reply(b"\x93garbage", Ack)


def test_a_reply_from_another_protocol_version_says_so():
    data = msgspec.msgpack.encode({"type": "ErrorReply", "v": 2, "code": "internal", "message": "x"})
    with pytest.raises(ProtocolVersionError, match="protocol v2"):
        schema.decode_reply(data, Ack)


def test_no_reply_carries_an_error_beside_its_fields():
    """Errors travel as ErrorReply alone: no reply has an `error` field to leave unset."""
    replies = [m for m in _messages() if m.__name__.endswith("Reply") or m is Ack]
    assert {"AdmitReply", "ReserveReply", "StoreStatsReply", "KVSnapshotReply", "Ack"} <= {m.__name__ for m in replies}
    assert [m.__name__ for m in replies if "error" in m.__struct_fields__] == []


def _messages() -> list[type[Message]]:
    found, todo = [], [Message]
    while todo:
        kind = todo.pop()
        found.append(kind)
        todo.extend(kind.__subclasses__())
    return found
