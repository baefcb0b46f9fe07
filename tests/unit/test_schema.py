"""The wire vocabulary: a reply is its request's reply or an ErrorReply, tagged; a
heartbeat carries its role's payload."""

import msgspec
import pytest

from libs.protocol import schema
from libs.protocol.schema import (
    Ack,
    AdmitReply,
    BadMessageError,
    DecodeBeat,
    ErrorReply,
    GatewayBeat,
    Heartbeat,
    KVContract,
    Message,
    PrefillBeat,
    ProtocolVersionError,
    StoreBeat,
    StoreCommitReply,
)
from libs.protocol.vocabulary import ErrorCode, Role

CONTRACT = KVContract(model_id="tiny", block_size=16, layout="2x16x4x8 bf16", hash_scheme="sha256-v1")


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


def test_a_heartbeat_carries_what_its_role_publishes_and_reads_the_same_for_every_role():
    pool = dict(capacity=64, free_blocks=48, segment="kvserve-p1", contract=CONTRACT)
    prefill = Heartbeat(instance_id="p1", role=Role.PREFILL, host_id="h", payload=PrefillBeat(
        load=2, queued_tokens=300, kv_epoch=7, kv_seq=41, **pool))  # fmt: skip
    decode = Heartbeat(instance_id="d1", role=Role.DECODE, host_id="h", payload=DecodeBeat(
        load=3, batch_size=3, context_tokens=900, **pool))  # fmt: skip
    store = Heartbeat(instance_id="s1", role=Role.STORE, host_id="h", payload=StoreBeat(kv_epoch=9, kv_seq=2, **pool))
    gateway = Heartbeat(instance_id="g1", role=Role.GATEWAY, host_id="h", address="http://127.0.0.1:8000",
                        payload=GatewayBeat(load=5))  # fmt: skip
    beats = [schema.decode(schema.encode(b), Heartbeat) for b in (prefill, decode, store, gateway)]
    assert beats == [prefill, decode, store, gateway]
    assert [b.load for b in beats] == [2, 3, 0, 5]
    assert [(b.capacity, b.free_blocks, b.segment, b.contract) for b in beats] == [
        (64, 48, "kvserve-p1", CONTRACT)] * 3 + [(0, 0, None, None)]  # fmt: skip
    assert [(b.kv_epoch, b.kv_seq) for b in beats] == [(7, 41), (0, 0), (9, 2), (0, 0)]
    assert [(b.queued_tokens, b.batch_size, b.context_tokens) for b in beats[:2]] == [(300, 0, 0), (0, 3, 900)]
    bare = Heartbeat(instance_id="c1", role=Role.CONDUCTOR, host_id="h")  # nothing more to say yet
    assert (bare.load, bare.pool, bare.cost) == (0, None, None)


def test_a_heartbeat_carrying_another_roles_payload_is_a_bad_message():
    data = msgspec.msgpack.encode({"type": "Heartbeat", "v": 1, "instance_id": "d1", "role": "decode", "host_id": "h",
                                   "payload": {"type": "PrefillBeat", "load": 1}})  # fmt: skip
    with pytest.raises(BadMessageError, match="a decode heartbeat carrying a PrefillBeat"):
        schema.decode(data, Heartbeat)
