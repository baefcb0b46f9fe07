"""The TCP transport's wire format: what a sender and a receiver say on a connection.

Per connection::

    sender:   greeting: b"KVT2", ticket id (16 bytes), nonce (u64), proof (16 bytes)
    receiver: 1 status byte (OK, or REFUSED for a ticket it did not issue, has closed,
              or that this greeting may not use)
    sender:   frames: u64 dst_offset, u64 length (little-endian), then `length` bytes; ...
              then the end frame (END_OFFSET, 0)
    receiver: 1 status byte: OK once every byte is in the segment, else why not

With TLS on the data plane (`tls.py`), the sender first opens a TLS session in which the
two agree keys, and all of this is said in records sealed under them (`sealed.py`); a
receiver with TLS answers a sender without it TLS_REQUIRED, in clear, and closes. The
token itself never crosses the wire: the greeting names the ticket by a hash of
its token and proves the sender holds the token with an HMAC of a fresh nonce
(`tickets.py`), so each greeting is good once. A transfer sliced over several
connections greets on each with a new nonce. After an OK the connection may carry
another transfer, greeted for that transfer's own ticket.
"""

import itertools
import secrets
import struct
from collections.abc import Iterator
from enum import IntEnum

from libs.protocol.vocabulary import ErrorCode
from libs.transfer.tickets import PROOF_LEN, TICKET_ID_LEN, greeting_proof, ticket_id

MAGIC = b"KVT2"
GREETING = struct.Struct(f"<{TICKET_ID_LEN}sQ{PROOF_LEN}s")  # after MAGIC: ticket id, nonce, proof
FRAME = struct.Struct("<QQ")
END_OFFSET = (1 << 64) - 1


class Status(IntEnum):
    """The receiver's one-byte answer to a greeting or to a transfer's end frame."""

    OK = 0
    REFUSED = 1  # the greeting's ticket is unknown, closed, spent, or not this greeting's to use
    BAD_FRAME = 2  # a frame outside the ticket's ranges, or over bytes already written
    SHORT = 3  # the stream ended inside a frame
    FAILED = 4  # the receiver could not finish (timeout, broken connection)
    BUSY = 5  # the receiver has too many connections
    TLS_REQUIRED = 6  # in clear, to a sender without TLS: this receiver speaks only TLS


# What a sender's TransferError says for each refusal.
STATUS_CAUSE = {
    Status.REFUSED: ErrorCode.BAD_TOKEN,
    Status.BAD_FRAME: ErrorCode.BAD_RANGE,
    Status.SHORT: ErrorCode.TRUNCATED,
    Status.FAILED: ErrorCode.PEER_GONE,
    Status.BUSY: ErrorCode.PEER_GONE,
    Status.TLS_REQUIRED: ErrorCode.TLS,
}


def greeting(token: str, nonce: int) -> bytes:
    """What a sender says first for one transfer on a connection; good for one use."""
    return MAGIC + GREETING.pack(ticket_id(token), nonce, greeting_proof(token, nonce))


def new_nonces() -> Iterator[int]:
    """Greeting nonces for one transfer's connections: a random start, then counting up."""
    return itertools.count(secrets.randbits(62))
