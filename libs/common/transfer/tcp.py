"""The TCP transport: a listener that writes incoming frames straight into
registered segments (``recv_into``, no intermediate copies), and a connection
that sends spans of a source segment as frames (``sendmsg``, no copies either).

Wire format, per connection::

    sender:   b"KVT1" + token (32 ASCII bytes)
    receiver: 1 status byte (OK, or REFUSED for a token it did not issue or has closed)
    sender:   frames: u64 dst_offset, u64 length (little-endian), then `length` bytes; ...
              then the end frame (END_OFFSET, 0)
    receiver: 1 status byte: OK once every byte is in the segment, else why not

After an OK the connection may carry another transfer: the sender greets again with
that transfer's own one-time token. Senders keep such idle connections in a small
per-peer pool (`IdleConnections`), so a small transfer costs one round trip for the
greeting and one for the final status, not a TCP handshake and a thread. A
connection grants nothing by itself: every transfer on it presents a token issued
for that transfer, and the receiver closes it at the first refusal or failure, or
after IDLE_SECONDS without a greeting.

Nothing is written for a connection whose token is refused, and nothing outside
the ranges its ticket allows. Blocking sockets on threads: the GIL is released in
every send/recv, and the event loop never waits on the wire.
"""

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.common import failpoints
from libs.common.transfer.descriptors import BAD_RANGE, BAD_TOKEN, PEER_GONE, TIMEOUT, TRUNCATED, Span, TransferError
from libs.common.transfer.ranges import RangeSet

log = logging.getLogger(__name__)

MAGIC = b"KVT1"
TOKEN_LEN = 32
FRAME = struct.Struct("<QQ")
END_OFFSET = (1 << 64) - 1
OK, REFUSED, BAD_FRAME, SHORT, FAILED = range(5)
GREETING_SECONDS = 30.0  # a new connection must greet within this
IDLE_SECONDS = 60.0  # the receiver closes a connection idle this long after a transfer
REUSE_SECONDS = 30.0  # the sender reuses an idle connection only this long (well before the receiver closes it)
IDLE_PER_PEER = 8
_STATUS_CAUSE = {REFUSED: BAD_TOKEN, BAD_FRAME: BAD_RANGE, SHORT: TRUNCATED, FAILED: PEER_GONE}


@dataclass
class OpenTicket:
    """The receiver's side of a ticket: where its token may write."""

    token: str
    view: memoryview  # the destination segment, as bytes
    allowed: RangeSet
    expires_at: float
    bytes_received: int = 0
    arrivals: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) per frame, in order
    failed: str | None = None  # a cause, once a connection broke mid-transfer


class TicketBook:
    """Tokens this process has issued and not yet closed. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._open: dict[str, OpenTicket] = {}
        self._lock = threading.Lock()
        self.clock = clock

    def open(self, ticket: OpenTicket) -> None:
        with self._lock:
            self._open[ticket.token] = ticket

    def get(self, token: str) -> OpenTicket | None:
        with self._lock:
            ticket = self._open.get(token)
            if ticket is not None and ticket.expires_at < self.clock():
                del self._open[token]
                return None
            return ticket

    def close(self, token: str) -> OpenTicket | None:
        with self._lock:
            return self._open.pop(token, None)

    def __len__(self) -> int:
        return len(self._open)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError(f"stream ended after {got} of {len(view)} bytes")
        got += n


class TcpListener:
    def __init__(self, host: str, port: int, tickets: TicketBook, on_frame_bytes: Callable[[int], None]) -> None:
        self.tickets = tickets
        self._on_bytes = on_frame_bytes
        self._sock = socket.create_server((host, port), backlog=64)
        self.address = "%s:%d" % self._sock.getsockname()[:2]
        self._closed = False
        self._count_lock = threading.Lock()
        self.accepted = 0  # connections accepted so far
        self.open_connections = 0  # ... and not yet closed
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-accept", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, peer), name="tcp-recv", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        with self._count_lock:
            self.accepted += 1
            self.open_connections += 1
        try:
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                served = 0
                while not self._closed and self._serve_one(conn, peer, first=served == 0):
                    served += 1
        finally:
            with self._count_lock:
                self.open_connections -= 1

    def _serve_one(self, conn: socket.socket, peer, first: bool) -> bool:
        """One transfer on the connection; whether the connection may carry another."""
        conn.settimeout(GREETING_SECONDS if first else IDLE_SECONDS)
        try:
            hello = bytearray(len(MAGIC) + TOKEN_LEN)
            _recv_exact(conn, memoryview(hello))
        except (OSError, EOFError) as e:
            if first:
                log.warning("TCP transfer from %s: no greeting (%s)", peer, e)
            return False  # a reused connection closed or left idle: nothing to report
        token = hello[len(MAGIC) :].decode("ascii", "replace")
        ticket = self.tickets.get(token) if hello.startswith(MAGIC) else None
        if ticket is None:
            log.warning("refused a TCP transfer from %s:%s: unknown, closed or expired token", *peer[:2])
            _send_status(conn, REFUSED)
            return False
        conn.settimeout(max(0.1, ticket.expires_at - self.tickets.clock()))
        _send_status(conn, OK)
        if failpoints.active("transfer.stall_receive"):
            log.warning("failpoint transfer.stall_receive: not reading from %s", peer[0])
            threading.Event().wait(ticket.expires_at - self.tickets.clock())
            return False
        status = self._receive_frames(conn, ticket, peer)
        _send_status(conn, status)
        return status == OK

    def _receive_frames(self, conn: socket.socket, ticket: OpenTicket, peer) -> int:
        header = bytearray(FRAME.size)
        try:
            while True:
                _recv_exact(conn, memoryview(header))
                offset, length = FRAME.unpack(header)
                if offset == END_OFFSET:
                    return OK
                if not ticket.allowed.contains(offset, length):
                    log.warning("refused a frame from %s: [%d, +%d) is outside its ticket", peer[0], offset, length)
                    return BAD_FRAME
                _recv_exact(conn, ticket.view[offset : offset + length])
                ticket.bytes_received += length
                ticket.arrivals.append((offset, length))
                self._on_bytes(length)
        except EOFError as e:
            ticket.failed = TRUNCATED
            log.warning("TCP transfer from %s truncated: %s", peer[0], e)
            return SHORT
        except TimeoutError:
            ticket.failed = TIMEOUT
            return FAILED
        except OSError as e:
            ticket.failed = PEER_GONE
            log.warning("TCP transfer from %s broke: %s", peer[0], e)
            return FAILED


def _send_status(conn: socket.socket, status: int) -> None:
    try:
        conn.sendall(bytes([status]))
    except OSError:
        pass


class IdleConnections:
    """Connections whose last transfer ended well, by receiver address, for reuse. Thread-safe."""

    def __init__(self, per_peer: int = IDLE_PER_PEER, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_peer = per_peer
        self.clock = clock
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}
        self._lock = threading.Lock()

    def take(self, address: str) -> socket.socket | None:
        stale = []
        with self._lock:
            idle = self._idle.get(address, [])
            while idle:
                sock, since = idle.pop()
                if self.clock() - since < REUSE_SECONDS:
                    break
                stale.append(sock)
            else:
                sock = None
        for s in stale:
            s.close()
        return sock

    def give(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < self.per_peer:
                idle.append((sock, self.clock()))
                return
        sock.close()

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for entries in idle.values():
            for sock, _ in entries:
                sock.close()


IDLE = IdleConnections()


class TcpConnection:
    """One sending connection of a transfer: a pooled idle one to the same receiver when
    there is one, else a new one. Not thread-safe: one thread drives it."""

    def __init__(self, address: str, token: str, deadline: float, pool: IdleConnections = IDLE) -> None:
        self.address = address
        self.deadline = deadline
        self.pool = pool
        self.sock = pool.take(address)
        if self.sock is not None:
            try:
                self._greet(token)
                return
            except TransferError as e:
                self.close()
                if e.cause != PEER_GONE:
                    raise
                # the receiver closed it while it sat idle: open a new one
        self.sock = self._connect(address)
        self._greet(token)

    def _connect(self, address: str) -> socket.socket:
        host, port = address.rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=self._remaining())
        except TimeoutError:
            raise TransferError(TIMEOUT, f"connecting to {address} timed out") from None
        except OSError as e:
            raise TransferError(PEER_GONE, f"cannot connect to {address}: {e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _greet(self, token: str) -> None:
        self._guard(lambda: self.sock.sendall(MAGIC + token.encode("ascii")))
        self._expect_ok("greeting")

    def _remaining(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TransferError(TIMEOUT, "transfer deadline passed")
        return remaining

    def send(self, source: memoryview, spans: list[Span]) -> None:
        for span in spans:
            header = FRAME.pack(span.dst_offset, span.length)
            payload = source[span.src_offset : span.src_offset + span.length]
            self._guard(lambda: _sendmsg_all(self.sock, [header, payload]))

    def finish(self) -> None:
        """Send the end frame and wait for the receiver's OK; the connection then goes
        back to the idle pool (on failure it raises, and the caller closes it)."""
        self._guard(lambda: self.sock.sendall(FRAME.pack(END_OFFSET, 0)))
        self._expect_ok("end of transfer")
        sock, self.sock = self.sock, None
        self.pool.give(self.address, sock)

    def close(self) -> None:
        if self.sock is None:
            return
        try:
            self.sock.close()
        except OSError:
            pass
        self.sock = None

    def _guard(self, action: Callable[[], None]) -> None:
        self.sock.settimeout(self._remaining())
        try:
            action()
        except TimeoutError:
            raise TransferError(TIMEOUT, "the receiver stopped taking bytes") from None
        except OSError as e:
            # the receiver may have said why before closing: prefer its reason
            raise TransferError(self._status_after_error() or PEER_GONE, f"connection lost: {e}") from None

    def _expect_ok(self, what: str) -> None:
        self.sock.settimeout(self._remaining())
        try:
            status = self.sock.recv(1)
        except TimeoutError:
            raise TransferError(TIMEOUT, f"no answer to the {what}") from None
        except OSError as e:
            raise TransferError(PEER_GONE, f"connection lost waiting for the {what}: {e}") from None
        if not status:
            raise TransferError(PEER_GONE, f"the receiver closed the connection at the {what}")
        if status[0] != OK:
            raise TransferError(_STATUS_CAUSE.get(status[0], PEER_GONE), f"the receiver refused the {what}")

    def _status_after_error(self) -> str | None:
        try:
            self.sock.settimeout(0.2)
            status = self.sock.recv(1)
        except OSError:
            return None
        return _STATUS_CAUSE.get(status[0]) if status else None


def _sendmsg_all(sock: socket.socket, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
