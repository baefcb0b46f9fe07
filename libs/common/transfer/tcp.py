"""The TCP transport: a listener that writes incoming frames straight into
registered segments (``recv_into``, no intermediate copies), and a connection
that sends spans of a source segment as frames (``sendmsg``, no copies either).

Wire format, per connection::

    sender:   b"KVT1" + token (32 ASCII bytes)
    receiver: 1 status byte (OK, or REFUSED for a token it did not issue or has closed)
    sender:   frames: u64 dst_offset, u64 length (little-endian), then `length` bytes; ...
              then the end frame (END_OFFSET, 0)
    receiver: 1 status byte: OK once every byte is in the segment, else why not

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
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(30.0)
            try:
                hello = bytearray(len(MAGIC) + TOKEN_LEN)
                _recv_exact(conn, memoryview(hello))
            except (OSError, EOFError) as e:
                log.warning("TCP transfer from %s: no greeting (%s)", peer, e)
                return
            token = hello[len(MAGIC) :].decode("ascii", "replace")
            ticket = self.tickets.get(token) if hello.startswith(MAGIC) else None
            if ticket is None:
                log.warning("refused a TCP transfer from %s:%s: unknown, closed or expired token", *peer[:2])
                _send_status(conn, REFUSED)
                return
            conn.settimeout(max(0.1, ticket.expires_at - self.tickets.clock()))
            _send_status(conn, OK)
            if failpoints.active("transfer.stall_receive"):
                log.warning("failpoint transfer.stall_receive: not reading from %s", peer[0])
                threading.Event().wait(ticket.expires_at - self.tickets.clock())
                return
            _send_status(conn, self._receive_frames(conn, ticket, peer))

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


class TcpConnection:
    """One sending connection of a transfer. Not thread-safe: one thread drives it."""

    def __init__(self, address: str, token: str, deadline: float) -> None:
        host, port = address.rsplit(":", 1)
        self.deadline = deadline
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=self._remaining())
        except TimeoutError:
            raise TransferError(TIMEOUT, f"connecting to {address} timed out") from None
        except OSError as e:
            raise TransferError(PEER_GONE, f"cannot connect to {address}: {e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
        self._guard(lambda: self.sock.sendall(FRAME.pack(END_OFFSET, 0)))
        self._expect_ok("end of transfer")
        self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

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
