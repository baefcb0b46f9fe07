"""The TCP transport's sending side: a connection that sends spans of a source segment
as frames (``sendmsg``, no copies), in the wire format of `wire.py`. The receiving
side is `listener.py`.

Senders keep connections whose last transfer ended well in a small per-peer pool
(`IdleConnections`, one per engine), so a small transfer costs one round trip for
the greeting and one for the final status, not a TCP handshake and a thread; one the
receiver has closed meanwhile is replaced without a word.

With TLS on the data plane (``tls``, the client context of `tls.py`), a new connection
opens its TLS session and agrees its keys before the greeting, then carries sealed
records (`sealed.py`); a pooled one keeps its keys until they have sealed enough.

Blocking sockets on pooled threads: the GIL is released in every send/recv (and in
the records' encryption), and the event loop never waits on the wire.
"""

import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

from libs.protocol.vocabulary import ErrorCode
from libs.transfer.descriptors import Span, TransferError
from libs.transfer.tcp.sealed import SealedSocket, seal_sender
from libs.transfer.tcp.wire import END_OFFSET, FRAME, STATUS_CAUSE, Status, greeting, new_nonces

REUSE_SECONDS = 30.0  # the sender reuses an idle connection only this long
IDLE_PER_PEER = 8
_STATUS_TEXT = {
    Status.BUSY: "has too many connections",
    Status.TLS_REQUIRED: "requires TLS on the data plane, and this sender has none (KVSERVE_TRANSFER_TLS_*)",
}


def _cause(error: OSError) -> ErrorCode:
    """A broken connection's cause: TLS when the TLS session failed (an alert: the peer
    refused our certificate, say), else the peer gone. An EOF inside TLS is the peer gone."""
    if isinstance(error, ssl.SSLError) and not isinstance(error, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return ErrorCode.TLS
    return ErrorCode.PEER_GONE


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle connection was closed (or written to) by the receiver: either
    way it cannot carry a transfer. A poll, no wait."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


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
                if self.clock() - since < REUSE_SECONDS and not _closed_by_peer(sock):
                    break
                stale.append(sock)  # too old, or the receiver closed it (idle timeout, restart)
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


class TcpConnection:
    """One sending connection of a transfer: an idle one from ``pool`` to the same receiver
    when there is one, else a new one. ``nonces``: where each greeting takes its nonce (one
    shared by a transfer's connections; by default a fresh random run). Not thread-safe:
    one thread drives it."""

    def __init__(
        self, address: str, token: str, deadline: float, pool: IdleConnections,
        nonces: Iterator[int] | None = None, tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        self.address = address
        self.deadline = deadline
        self.pool = pool
        self.tls = tls
        nonces = new_nonces() if nonces is None else nonces
        self.sock = pool.take(address)
        if self.sock is not None:
            try:
                self._greet(token, next(nonces))
                return
            except TransferError as e:
                self.close()
                if e.cause != ErrorCode.PEER_GONE:
                    raise
                # the receiver closed it just now: a new connection, with a nonce the
                # receiver has not seen (it may have taken the last greeting before closing)
        self.sock = self._connect(address)
        self._greet(token, next(nonces))

    def _connect(self, address: str) -> socket.socket:
        host, port = address.rsplit(":", 1)
        try:
            sock = socket.create_connection((host, int(port)), timeout=self._remaining())
        except TimeoutError:
            raise TransferError(ErrorCode.TIMEOUT, f"connecting to {address} timed out") from None
        except OSError as e:
            raise TransferError(ErrorCode.PEER_GONE, f"cannot connect to {address}: {e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is None:
            return sock
        try:
            sock.settimeout(self._remaining())
            return seal_sender(self.tls.wrap_socket(sock))  # the handshake and the keys, within the deadline
        except TimeoutError:
            sock.close()
            raise TransferError(ErrorCode.TIMEOUT, f"TLS handshake with {address} timed out") from None
        except OSError as e:  # any failure here is the handshake's: a plain receiver, an unknown CA
            sock.close()
            raise TransferError(ErrorCode.TLS, (
                f"TLS handshake with {address} failed: {e} (does the receiver use TLS, with a certificate "
                f"from the same CA?)")) from None  # fmt: skip

    def _greet(self, token: str, nonce: int) -> None:
        hello = greeting(token, nonce)
        self._guard(lambda: self.sock.sendall(hello))
        self._expect_ok("greeting")

    def _remaining(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TransferError(ErrorCode.TIMEOUT, "transfer deadline passed")
        return remaining

    def send(self, source: memoryview, spans: list[Span]) -> None:
        for span in spans:
            header = FRAME.pack(span.dst_offset, span.length)
            payload = source[span.src_offset : span.src_offset + span.length]
            if self.tls is None:
                self._guard(lambda: _sendmsg_all(self.sock, [header, payload]))
            else:  # sealed: the header is a record of its own, so the payload's open straight into place
                self._guard(lambda: self.sock.sendall_parts([header, payload]))

    def finish(self) -> None:
        """Send the end frame and wait for the receiver's OK; the connection then goes
        back to the idle pool (on failure it raises, and the caller closes it)."""
        self._guard(lambda: self.sock.sendall(FRAME.pack(END_OFFSET, 0)))
        self._expect_ok("end of transfer")
        sock, self.sock = self.sock, None
        if isinstance(sock, SealedSocket) and sock.worn:
            sock.close()  # its keys have sealed enough: the next transfer gets a new connection
            return
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
            raise TransferError(ErrorCode.TIMEOUT, "the receiver stopped taking bytes") from None
        except OSError as e:
            # the receiver may have said why before closing: prefer its reason
            cause = _cause(e)
            if cause != ErrorCode.TLS:
                cause = self._status_after_error() or ErrorCode.PEER_GONE
            raise TransferError(cause, f"connection lost: {e}") from None

    def _expect_ok(self, what: str) -> None:
        self.sock.settimeout(self._remaining())
        try:
            status = self.sock.recv(1)
        except TimeoutError:
            raise TransferError(ErrorCode.TIMEOUT, f"no answer to the {what}") from None
        except OSError as e:
            raise TransferError(_cause(e), f"connection lost waiting for the {what}: {e}") from None
        if not status:
            raise TransferError(ErrorCode.PEER_GONE, f"the receiver closed the connection at the {what}")
        if status[0] != Status.OK:
            why = _STATUS_TEXT.get(status[0], f"refused the {what}")
            raise TransferError(STATUS_CAUSE.get(status[0], ErrorCode.PEER_GONE), f"the receiver {why}")

    def _status_after_error(self) -> ErrorCode | None:
        try:
            self.sock.settimeout(0.2)
            status = self.sock.recv(1)
        except OSError as e:
            return ErrorCode.TLS if _cause(e) == ErrorCode.TLS else None
        return STATUS_CAUSE.get(status[0]) if status else None


def _sendmsg_all(sock: socket.socket, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
