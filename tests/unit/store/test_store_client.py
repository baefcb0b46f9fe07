"""The typed store client against a fake connection: each operation's subject,
request and reply type, and every failure mapped to one StoreError."""

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from libs.common.store_client import BAD_REPLY, STORE_CALLS, UNAVAILABLE, StoreClient, StoreError
from libs.protocol import schema, subjects
from libs.protocol.schema import ErrorReply, Message, StoreCommitReply, StoreExistsReply, StorePutReply
from tests.unit.store.conftest import CONTRACT, h


class Answer:
    def __init__(self, data: bytes) -> None:
        self.data = data


class FakeNats:
    """Answers every request with the next of ``answers`` (a Message, raw bytes, or an exception)."""

    def __init__(self, *answers: Message | bytes | Exception) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[str, Message]] = []

    async def request(self, subject: str, data: bytes, timeout: float) -> Answer:
        request_type = STORE_CALLS[subject.rsplit(".", 1)[-1]][0]
        self.sent.append((subject, schema.decode(data, request_type)))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return Answer(answer if isinstance(answer, bytes) else schema.encode(answer))


def test_every_store_operation_has_one_request_and_reply_pair():
    assert tuple(STORE_CALLS) == subjects.STORE_OPS
    assert {request.__name__ for request, _ in STORE_CALLS.values()} == {
        f"Store{op.capitalize()}Request" for op in subjects.STORE_OPS}  # fmt: skip


async def test_calls_go_to_the_operation_subject_with_the_client_contract():
    nc = FakeNats(StoreExistsReply(tiers=["dram", None]), StorePutReply(put_id="p1", missing=[0]),
                  StoreCommitReply(num_stored=1))  # fmt: skip
    client = StoreClient(nc, CONTRACT)
    assert await client.exists("store-a", [h(1), h(2)]) == ["dram", None]
    assert (await client.put("store-a", [h(3)], 256, pin=True)).put_id == "p1"
    assert await client.commit("store-a", "p1") == 1
    ops = ("exists", "put", "commit")
    assert [subject for subject, _ in nc.sent] == [subjects.store_op("store-a", op) for op in ops]
    exists, put, commit = (request for _, request in nc.sent)
    assert exists.block_hashes == [h(1), h(2)] and exists.contract == CONTRACT
    assert put.pin and put.block_nbytes == 256 and commit.put_id == "p1"


@pytest.mark.parametrize(
    ("answer", "code"),
    [
        (ErrorReply(code="unknown_put", message="no put"), "unknown_put"),
        (ErrorReply(code="bad_message", message="undecodable"), "bad_message"),
        (StoreExistsReply(tiers=[]), BAD_REPLY),  # another operation's reply
        (b"\x93garbage", BAD_REPLY),
        (NoRespondersError(), UNAVAILABLE),
        (NatsTimeout(), UNAVAILABLE),
    ],
)
async def test_every_failure_is_a_store_error(answer, code):
    with pytest.raises(StoreError) as failed:
        await StoreClient(FakeNats(answer), CONTRACT).commit("store-a", "p1")
    assert failed.value.code == code and failed.value.store == "store-a" and failed.value.op == "commit"
    assert failed.value.refused == (code not in (BAD_REPLY, UNAVAILABLE))
