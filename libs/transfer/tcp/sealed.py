"""Sealed records: how the TCP data plane's bytes travel once a TLS session has
authenticated both ends.

A connection opens with a TLS 1.3 handshake, mutual, from the cluster CA (`tls.py`). Inside
that session each side sends `EXCHANGE_MAGIC` and 32 random bytes (the sender first; a peer
that says anything else speaks another version and is refused); from both, HKDF-SHA256
derives one AES-256-GCM key per direction. TLS's records end there: the rest of the
connection is records of our own, each

    u32 length (little-endian, clear, authenticated), then `length` bytes sealed, then a 16-byte tag

with a 96-bit nonce that counts the direction's records from 0 (never sent: a record
dropped, replayed or moved fails its tag, and the connection ends). Why not TLS's own
records: Python's `ssl` uses the system's OpenSSL and cuts a transfer into 16 KiB records,
one or two system calls each; `cryptography`'s OpenSSL seals 1 MiB records with the
CPU's vector AES instructions where it has them (measured in bench/results/transfer.md).

Nothing is read past the TLS session's last record (OpenSSL reads no further ahead than
one record), so the switch needs no round trip of its own. A sender does not reuse a
connection once either direction has sealed `KEY_BYTES_LIMIT` bytes under its key (checked
between transfers), well inside what TLS 1.3 allows one AES-GCM key (about 2^38.5 bytes).

`SealedSocket` has the socket methods the transport uses. As with TLS, a `send` that
would block (non-blocking socket) must be called again with the same bytes.
"""

import os
import socket
import ssl
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

RECORD_BYTES = 1 << 20  # the most a record seals
TAG = 16
HEADER = struct.Struct("<I")
SECRET_BYTES = 32
EXCHANGE_MAGIC = b"KVS1"  # what each side's secret comes after: this version of sealed records
EXCHANGE_BYTES = len(EXCHANGE_MAGIC) + SECRET_BYTES
SMALL = 4096  # a read takes up to this much past its record; a write, a header record before a full one
KEY_BYTES_LIMIT = 1 << 36  # 64 GiB a direction; then the connection is not reused
_INFO = b"kvserve transfer records v1"


class SealError(ssl.SSLError):
    """A record that failed its tag, or a length no sender would seal: the connection is not to be trusted."""


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(12, "little")


def derive_keys(sender_secret: bytes, receiver_secret: bytes) -> tuple[bytes, bytes]:
    """The keys of the two directions: (sender to receiver, receiver to sender)."""
    material = HKDF(algorithm=hashes.SHA256(), length=64, salt=None, info=_INFO).derive(
        sender_secret + receiver_secret
    )
    return material[:32], material[32:]


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


def exchange_message(secret: bytes) -> bytes:
    """What a side says in the TLS session: the magic, then its secret."""
    return EXCHANGE_MAGIC + secret


def peer_secret(message: bytes, peer: str) -> bytes:
    """The secret in what ``peer`` said; SealError when it is not this version's exchange."""
    if len(message) != EXCHANGE_BYTES or not message.startswith(EXCHANGE_MAGIC):
        raise SealError(f"the {peer} did not open sealed records (a kvserve of another version?)")
    return message[len(EXCHANGE_MAGIC) :]


class SealedSocket:
    """A connection's plain socket, its bytes sealed in records under ``send_key`` and
    opened under ``recv_key``. ``version`` and ``peer_subject``: the TLS session's, for
    logs and checks. One thread uses it at a time."""

    def __init__(
        self, sock: socket.socket, send_key: bytes, recv_key: bytes, version: str | None = None, peer_subject=None
    ) -> None:
        self._sock = sock
        self._seal = AESGCM(send_key)
        self._open = AESGCM(recv_key)
        self.version = version
        self.peer_subject = peer_subject
        self._sent = 0  # records sealed, hence the next nonce
        self._opened = 0
        self.sealed_bytes = 0
        self.opened_bytes = 0
        self._out = bytearray(0)  # where sendall seals, grown on first need (a receiver's stays small)
        self._pending: memoryview | None = None  # a record `send` sealed and has not all written
        self._pending_length = 0
        # what has been read and not yet opened: self._in[self._start : self._end], grown on
        # first need as `_out`; and plain bytes of an opened record a short read left
        self._in = bytearray(0)
        self._start = self._end = 0
        self._plain = memoryview(b"")

    @property
    def worn(self) -> bool:
        """Whether the keys have sealed or opened enough that this connection should not be reused."""
        return max(self.sealed_bytes, self.opened_bytes) >= KEY_BYTES_LIMIT

    # --- sending ---------------------------------------------------------------
    def _seal_into(self, data, out: memoryview) -> int:
        """``data`` (at most RECORD_BYTES) as one record at the start of ``out``; its length."""
        n = len(data)
        HEADER.pack_into(out, 0, n)
        header = out[: HEADER.size]
        self._seal.encrypt_into(_nonce(self._sent), data, header, out[HEADER.size : HEADER.size + n + TAG])
        self._sent += 1
        self.sealed_bytes += n
        return HEADER.size + n + TAG

    def sendall(self, data) -> None:
        self.sendall_parts([data])

    def sendall_parts(self, parts: list) -> None:
        """Each of ``parts`` in records of its own (so a reader of each part's length gets it
        whole), as few writes as fit: a frame's header goes out with its first bytes."""
        views = [memoryview(part).cast("B") for part in parts]
        largest = max((min(len(v), RECORD_BYTES) for v in views), default=0)
        self._out = _room(self._out, SMALL + HEADER.size + largest + TAG)
        out = memoryview(self._out)
        used = 0
        for view in views:
            for start in range(0, len(view), RECORD_BYTES):
                piece = view[start : start + RECORD_BYTES]
                if used and used + HEADER.size + len(piece) + TAG > len(out):
                    self._sock.sendall(out[:used])
                    used = 0
                used += self._seal_into(piece, out[used:])
        if used:
            self._sock.sendall(out[:used])

    def send(self, data) -> int:
        """Seal up to a record of ``data`` and write it whole; BlockingIOError (call again
        with the same bytes) while the socket cannot take the rest of it."""
        if self._pending is None:
            view = memoryview(data).cast("B")[:RECORD_BYTES]
            if not view:
                return 0
            record = bytearray(HEADER.size + len(view) + TAG)
            self._seal_into(view, memoryview(record))
            self._pending, self._pending_length = memoryview(record), len(view)
        while self._pending:
            self._pending = self._pending[self._sock.send(self._pending) :]
        self._pending = None
        return self._pending_length

    # --- receiving ---------------------------------------------------------------
    def recv_into(self, buffer, nbytes: int = 0) -> int:
        """Up to ``nbytes`` (all of ``buffer`` by default) plain bytes of the next record
        (or of what a short read left of one); 0 at the end of the stream, including one
        that ends inside a record. A whole record lands in ``buffer`` with no copy when it fits."""
        view = memoryview(buffer).cast("B")
        if nbytes:
            view = view[:nbytes]
        if not view:
            return 0
        if not self._plain:
            record = self._read_record()
            if record is None:
                return 0
            at, length = record
            body = memoryview(self._in)[at : at + length + TAG]
            if length <= len(view):
                self._unseal(body, view[:length], length)
                return length
            plain = bytearray(length)
            self._unseal(body, memoryview(plain), length)
            self._plain = memoryview(plain)
        n = min(len(view), len(self._plain))
        view[:n] = self._plain[:n]
        self._plain = self._plain[n:]
        return n

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if flags:
            raise ValueError("a sealed socket takes no recv flags")
        buffer = bytearray(bufsize)
        return bytes(buffer[: self.recv_into(buffer)])

    def _read_record(self) -> tuple[int, int] | None:
        """The next record: where its sealed bytes start in ``self._in`` and its plain length;
        None at the end of the stream. Reads at most SMALL bytes past the record, so that the
        next one's header (or a small record whole) comes in the same read; keeps what it has
        when the socket would block or times out."""
        while True:
            have = self._end - self._start
            need = HEADER.size
            if have >= HEADER.size:
                (length,) = HEADER.unpack_from(self._in, self._start)
                if not 0 < length <= RECORD_BYTES:  # (an empty one would read as the end of the stream)
                    raise SealError(f"a sealed record of {length} bytes (1 to {RECORD_BYTES})")
                need = HEADER.size + length + TAG
                if have >= need:
                    at = self._start + HEADER.size
                    self._start += need
                    if self._start == self._end:
                        self._start = self._end = 0
                    return at, length
            if self._start + need + SMALL > len(self._in):  # move what is left of the stream to the front
                room = _room(self._in, need + SMALL)
                room[:have] = self._in[self._start : self._end]
                self._in, self._start, self._end = room, 0, have
            n = self._sock.recv_into(memoryview(self._in)[self._end : self._start + need + SMALL])
            if n == 0:
                return None
            self._end += n

    def _unseal(self, body: memoryview, into: memoryview, length: int) -> None:
        try:
            self._open.decrypt_into(_nonce(self._opened), body, HEADER.pack(length), into)
        except InvalidTag:  # tampered, replayed, reordered or dropped
            raise SealError("a sealed record failed its check (InvalidTag)") from None
        self._opened += 1
        self.opened_bytes += length

    # --- the plain socket's -------------------------------------------------------
    def fileno(self) -> int:
        return self._sock.fileno()

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def setblocking(self, flag: bool) -> None:
        self._sock.setblocking(flag)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()


def _room(buffer: bytearray, need: int) -> bytearray:
    """``buffer`` if it holds ``need`` bytes, else a new one: twice SMALL for small records,
    else room for a whole record and SMALL more."""
    if len(buffer) >= need:
        return buffer
    return bytearray(2 * SMALL if need <= 2 * SMALL else SMALL + HEADER.size + RECORD_BYTES + TAG)


def _switch(tls: ssl.SSLSocket, send_key: bytes, recv_key: bytes) -> SealedSocket:
    """``tls``'s connection, its TLS session ended without a word (both sides switch at
    the same point of the exchange), carrying sealed records from now on."""
    version, subject = tls.version(), (tls.getpeercert() or {}).get("subject")
    timeout = tls.gettimeout()
    plain = socket.socket(tls.family, tls.type, tls.proto, fileno=tls.detach())
    plain.settimeout(timeout)
    return SealedSocket(plain, send_key, recv_key, version, subject)


def seal_sender(tls: ssl.SSLSocket) -> SealedSocket:
    """The sending side's exchange, on a blocking TLS socket whose handshake is done."""
    mine = new_secret()
    tls.sendall(exchange_message(mine))
    theirs = bytearray()
    while len(theirs) < EXCHANGE_BYTES:
        chunk = tls.recv(EXCHANGE_BYTES - len(theirs))
        if not chunk:
            break  # what it said so far tells why: a receiver of another version refuses and closes
        theirs += chunk
    send_key, recv_key = derive_keys(mine, peer_secret(bytes(theirs), "receiver"))
    return _switch(tls, send_key, recv_key)


def seal_receiver(tls: ssl.SSLSocket, sender_secret: bytes, mine: bytes) -> SealedSocket:
    """The receiving side, once it has read the sender's secret and sent its own."""
    sender_to_receiver, receiver_to_sender = derive_keys(sender_secret, mine)
    return _switch(tls, receiver_to_sender, sender_to_receiver)
