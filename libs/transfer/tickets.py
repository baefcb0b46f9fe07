"""The receiver's side of write tickets: what each issued token may write, and how a
sender proves it holds the token without the token crossing the wire.

A `WriteTicket.token` is a secret the receiver hands one sender over the control
plane. On a TCP connection the sender shows only the ticket's public id and an HMAC,
keyed by the token, of a nonce it has not used before: a sniffed greeting cannot be
replayed (its nonce is spent) nor turned into another (that needs the token). Every
byte range of a ticket is written at most once, and a ticket serves one transport:
the first writer — a TCP greeting here, or a shared-memory writer on this host —
claims it by creating a file next to the segment exclusively, and the other is
refused.
"""

import hashlib
import heapq
import hmac
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from libs.protocol.vocabulary import ErrorCode
from libs.transfer.ranges import RangeSet, WrittenRanges
from libs.transfer.segment import SHM_DIR

TICKET_ID_LEN = 16
PROOF_LEN = 16

class Refusal(StrEnum):
    """Why a connection, a greeting or a frame was refused: the ``reason`` label of
    kvserve_transfer_refused_total."""

    TOO_MANY = "too_many_connections"  # the listener holds as many connections as it may
    BAD_GREETING = "bad_greeting"  # not a kvserve transfer greeting
    UNKNOWN = "unknown_ticket"  # never issued here, closed or expired
    FORGED = "bad_proof"  # the id of a live ticket without proof of its token
    REPLAYED = "replayed"  # a greeting already used (a sniffed one, sent again)
    NOT_TCP = "not_tcp"  # issued for a writer on this host: shared memory only
    CLAIMED = "claimed"  # already being written over shared memory
    SPENT = "spent"  # every byte it allows is written
    OUTSIDE = "outside_ticket"  # a frame for bytes the ticket does not allow
    REWRITE = "already_written"  # a frame for bytes (some of) which were written before
    TLS_HANDSHAKE = "tls_handshake"  # no certificate the CA signed (the data plane's TLS)
    TLS_MISMATCH = "tls_mismatch"  # TLS on one side only

    @property
    def text(self) -> str:
        return _REFUSAL_TEXT[self]


_REFUSAL_TEXT = {
    Refusal.TOO_MANY: "too many connections",
    Refusal.BAD_GREETING: "not a kvserve transfer greeting",
    Refusal.UNKNOWN: "unknown, closed or expired ticket",
    Refusal.FORGED: "no proof of the ticket's token",
    Refusal.REPLAYED: "a greeting used before (replayed)",
    Refusal.NOT_TCP: "the ticket was issued for a shared-memory writer",
    Refusal.CLAIMED: "the ticket was used over shared memory",
    Refusal.SPENT: "every byte of the ticket is written",
    Refusal.OUTSIDE: "outside its ticket",
    Refusal.REWRITE: "already written",
    Refusal.TLS_HANDSHAKE: "TLS handshake failed (no certificate the cluster CA signed?)",
    Refusal.TLS_MISMATCH: "TLS on one side only (KVSERVE_TRANSFER_TLS_*)",
}


def ticket_id(token: str) -> bytes:
    """The public name of a ticket on the wire: a hash of its token, which it does not reveal."""
    return hashlib.sha256(b"kvserve ticket\0" + token.encode()).digest()[:TICKET_ID_LEN]


def greeting_proof(token: str, nonce: int) -> bytes:
    return hmac.new(token.encode(), b"kvserve greeting\0" + nonce.to_bytes(8, "little"), "sha256").digest()[:PROOF_LEN]


def claim_path(segment: str, tid: bytes) -> Path:
    """Beside the segment, named after it: a crashed owner's claims go with its segments."""
    return SHM_DIR / f"{segment}.claim-{tid.hex()}"


def claim(segment: str, tid: bytes) -> bool:
    """Take the ticket for one transport; False if a writer on the other already did."""
    try:
        fd = os.open(claim_path(segment, tid), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    os.close(fd)
    return True


@dataclass
class OpenTicket:
    """An issued ticket: where its token may write, and what has been written."""

    token: str
    segment: str
    view: memoryview  # the destination segment, as bytes
    allowed: RangeSet
    expires_at: float
    tcp: bool = True  # a TCP greeting may use it (it was issued with the listener's address)
    bytes_received: int = 0
    arrivals: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) per frame, in order
    failed: ErrorCode | None = None  # once a connection broke mid-transfer
    id: bytes = b""
    claimed: bool = False  # a TCP greeting has taken it
    nonces: set[int] = field(default_factory=set)
    written: WrittenRanges = field(default_factory=WrittenRanges)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.id = ticket_id(self.token)

    def admit(self, nonce: int, proof: bytes) -> Refusal | None:
        """Check one TCP greeting; None if it may write, else the reason it may not."""
        if not hmac.compare_digest(proof, greeting_proof(self.token, nonce)):
            return Refusal.FORGED  # checked first: without the token no nonce is spent
        with self.lock:
            if not self.tcp:
                return Refusal.NOT_TCP
            if nonce in self.nonces:
                return Refusal.REPLAYED
            if self.written.total >= self.allowed.total:
                return Refusal.SPENT
            if not self.claimed:
                if not claim(self.segment, self.id):
                    return Refusal.CLAIMED
                self.claimed = True
            self.nonces.add(nonce)
        return None

    def reserve(self, offset: int, length: int) -> Refusal | None:
        """Take ``[offset, +length)`` for one frame before a byte of it is read; else why not."""
        if not self.allowed.contains(offset, length):
            return Refusal.OUTSIDE
        with self.lock:
            return None if self.written.add(offset, length) else Refusal.REWRITE

    def arrived(self, offset: int, length: int) -> None:
        with self.lock:
            self.bytes_received += length
            self.arrivals.append((offset, length))


class TicketBook:
    """Tickets this process has issued and not yet closed, by id. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._open: dict[bytes, OpenTicket] = {}
        self._expiry: list[tuple[float, bytes]] = []  # a heap: expired tickets go at the next open
        self._lock = threading.Lock()
        self.clock = clock

    def open(self, ticket: OpenTicket) -> None:
        with self._lock:
            expired = self._take_expired()
            self._open[ticket.id] = ticket
            heapq.heappush(self._expiry, (ticket.expires_at, ticket.id))
        for old in expired:
            _unclaim(old)

    def get(self, tid: bytes) -> OpenTicket | None:
        with self._lock:
            ticket = self._open.get(tid)
            if ticket is None or ticket.expires_at >= self.clock():
                return ticket
            del self._open[tid]
        _unclaim(ticket)
        return None

    def close(self, token: str) -> OpenTicket | None:
        with self._lock:
            ticket = self._open.pop(ticket_id(token), None)
        if ticket is not None:
            _unclaim(ticket)
        return ticket

    def close_all(self) -> None:
        with self._lock:
            tickets, self._open, self._expiry = list(self._open.values()), {}, []
        for ticket in tickets:
            _unclaim(ticket)

    def _take_expired(self) -> list[OpenTicket]:  # called with the lock held
        now, expired = self.clock(), []
        while self._expiry and self._expiry[0][0] < now:
            _, tid = heapq.heappop(self._expiry)
            ticket = self._open.get(tid)
            if ticket is not None and ticket.expires_at < now:
                expired.append(self._open.pop(tid))
        return expired

    def __len__(self) -> int:
        return len(self._open)


def _unclaim(ticket: OpenTicket) -> None:
    if ticket.tcp:  # only a ticket TCP could use is ever claimed
        claim_path(ticket.segment, ticket.id).unlink(missing_ok=True)
