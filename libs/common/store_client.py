"""The store's operations as one typed client: a method per operation (exists, get,
put, commit, remove, stats), each one request/reply pair of `schema` sent on the
store instance's `subjects.store_op` subject, and every way a call can fail
raised as one `StoreError`.

It knows nothing of which store owns a block, nor of the bytes: a get writes
into the caller's ticket and a put hands back the store's; the caller moves
them with the transfer engine.
"""

from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from libs.protocol import schema, subjects
from libs.protocol.schema import (
    BadMessageError,
    CacheOwner,
    ErrorReply,
    KVContract,
    Message,
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
    WriteTicket,
)
from libs.protocol.vocabulary import StoreTier

STORE_CALLS: dict[str, tuple[type[Message], type[Message]]] = {  # op -> (request, reply)
    "exists": (StoreExistsRequest, StoreExistsReply),
    "get": (StoreGetRequest, StoreGetReply),
    "put": (StorePutRequest, StorePutReply),
    "commit": (StoreCommitRequest, StoreCommitReply),
    "remove": (StoreRemoveRequest, StoreRemoveReply),
    "stats": (StoreStatsRequest, StoreStatsReply),
}
assert tuple(STORE_CALLS) == subjects.STORE_OPS
_OP_OF = {request: op for op, (request, _) in STORE_CALLS.items()}

R = TypeVar("R", StoreExistsReply, StoreGetReply, StorePutReply, StoreCommitReply, StoreRemoveReply, StoreStatsReply)

UNAVAILABLE = "unavailable"  # no store answered in time (none listening, or too slow)
BAD_REPLY = "bad_reply"  # an answer that is not the operation's reply


class StoreError(Exception):
    """A store operation that did not succeed: ``code`` is the store's own error code
    when it refused (``contract_mismatch``, ``bad_block_size``, ``unknown_put``...),
    or UNAVAILABLE / BAD_REPLY when no usable answer came."""

    def __init__(self, store: str, op: str, code: str, message: str) -> None:
        super().__init__(f"store {store} {op}: {message}")
        self.store = store
        self.op = op
        self.code = code

    @property
    def refused(self) -> bool:
        """The store answered, and said no."""
        return self.code not in (UNAVAILABLE, BAD_REPLY)


class StoreClient:
    """Calls on any store instance, by instance id, under one KV contract."""

    def __init__(self, nc: NATS, contract: KVContract, timeout: float = 5.0) -> None:
        self.nc = nc
        self.contract = contract
        self.timeout = timeout

    async def exists(self, store: str, block_hashes: list[bytes]) -> list[StoreTier | None]:
        """The fastest tier holding each block, None where absent."""
        request = StoreExistsRequest(contract=self.contract, block_hashes=block_hashes)
        reply = await self._call(store, request, StoreExistsReply)
        return reply.tiers

    async def get(self, store: str, block_hashes: list[bytes], block_nbytes: int, ticket: WriteTicket,
                  offsets: list[int]) -> list[StoreTier | None]:  # fmt: skip
        """Have the store write each block it holds through ``ticket`` at its offset; the
        tier each came from, None for a miss."""
        request = StoreGetRequest(contract=self.contract, block_hashes=block_hashes, block_nbytes=block_nbytes,
                                  ticket=ticket, offsets=offsets)  # fmt: skip
        reply = await self._call(store, request, StoreGetReply)
        return reply.tiers

    async def put(self, store: str, block_hashes: list[bytes], block_nbytes: int, pin: bool = False,
                  host_id: str | None = None, owner: CacheOwner | None = None) -> StorePutReply:  # fmt: skip
        """Phase one of a put: which blocks the store lacks, and where to write them;
        ``owner``'s blocks."""
        request = StorePutRequest(contract=self.contract, block_hashes=block_hashes, block_nbytes=block_nbytes,
                                  pin=pin, host_id=host_id, owner=owner)  # fmt: skip
        return await self._call(store, request, StorePutReply)

    async def commit(self, store: str, put_id: str) -> int:
        """Phase two: the bytes are written; how many blocks are new to the store."""
        reply = await self._call(store, StoreCommitRequest(contract=self.contract, put_id=put_id), StoreCommitReply)
        return reply.num_stored

    async def remove(self, store: str, block_hashes: list[bytes]) -> int:
        """How many of the blocks some tier held."""
        request = StoreRemoveRequest(contract=self.contract, block_hashes=block_hashes)
        reply = await self._call(store, request, StoreRemoveReply)
        return reply.num_removed

    async def stats(self, store: str) -> StoreStatsReply:
        return await self._call(store, StoreStatsRequest(contract=self.contract), StoreStatsReply)

    async def _call(self, store: str, request: Message, kind: type[R]) -> R:
        """Send one operation's request; its reply, or a StoreError."""
        op = _OP_OF[type(request)]
        assert STORE_CALLS[op][1] is kind
        try:
            answer = await self.nc.request(subjects.store_op(store, op), schema.encode(request), timeout=self.timeout)
        except (NoRespondersError, NatsTimeout) as e:
            raise StoreError(store, op, UNAVAILABLE, str(e) or type(e).__name__) from None
        try:
            reply = schema.decode_reply(answer.data, kind)
        except BadMessageError as e:
            raise StoreError(store, op, BAD_REPLY, str(e) or "unexpected reply") from None
        if isinstance(reply, ErrorReply):
            raise StoreError(store, op, reply.code, reply.message)
        return reply
