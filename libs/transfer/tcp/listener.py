"""The TCP transport's receiving side: a listener that writes incoming frames straight
into registered segments (``recv_into``, no intermediate copies), and nothing else.

One thread runs an event loop that accepts connections, reads greetings and waits on
idle connections, so an idle connection costs a socket, never a thread. A greeted
transfer's frames are received on a pooled thread (at most one per connection, and
at most ``max_connections`` connections: more are closed at once). A connection that
says nothing for ``idle_timeout`` seconds is closed.

Nothing is written for a greeting that is refused (`tickets.py` says when), nor for
a frame outside its ticket's ranges or over bytes already written; each refusal is
logged — never with the token, which does not cross the wire — counted by reason,
and ends the connection.

With TLS (``tls``, the server context of `tls.py`), each accepted connection completes
its handshake and agrees its keys on the event loop before its greeting, and a sender
whose certificate the CA did not sign is refused there; a sender without TLS is answered
TLS_REQUIRED, in clear. From the greeting on, the connection's bytes are sealed records
(`sealed.py`), opened straight into the segment. The event loop drives plain, TLS and
sealed sockets alike through `_io`.
"""

import asyncio
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from libs.common import failpoints
from libs.protocol.vocabulary import ErrorCode
from libs.transfer.tcp.sealed import (
    EXCHANGE_BYTES,
    SealedSocket,
    SealError,
    exchange_message,
    new_secret,
    peer_secret,
    seal_receiver,
)
from libs.transfer.tcp.wire import END_OFFSET, FRAME, GREETING, MAGIC, Status
from libs.transfer.tickets import OpenTicket, Refusal, TicketBook
from libs.transfer.transfer_metrics import TransferMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")

CLOSE_WAIT_SECONDS = 5.0  # at close, how long connections get to end before they are dropped
HANDSHAKE_SECONDS = 10.0  # how long a new connection's TLS handshake may take
TLS_RECORD = 0x16  # the first byte a TLS client sends (a handshake record)


class TcpListener:
    def __init__(
        self,
        host: str,
        port: int,
        tickets: TicketBook,
        metrics: TransferMetrics | None = None,
        *,
        max_connections: int = 64,
        idle_timeout: float = 60.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if max_connections < 1 or idle_timeout <= 0:
            raise ValueError("max_connections and idle_timeout must be positive")
        self.tickets = tickets
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.tls = tls  # a server context: every connection is mutual TLS; None: plain TCP
        self.metrics = metrics if metrics is not None else TransferMetrics()
        self._sock = socket.create_server((host, port), backlog=128)
        self._sock.setblocking(False)
        self.address = "%s:%d" % self._sock.getsockname()[:2]
        self.accepted = 0  # connections served so far
        self.refused_connections = 0  # ... and closed at once, over max_connections
        self._conns: set[socket.socket] = set()
        self._closing = threading.Event()
        self._receivers = ThreadPoolExecutor(max_workers=max_connections, thread_name_prefix="kv-recv")
        self._loop = asyncio.new_event_loop()
        self._main: asyncio.Task | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="kv-listen", daemon=True)
        self._thread.start()
        started.wait()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        """Stop accepting, end every connection, and wait for the listener's thread. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._main.cancel)
            self._thread.join()
        self._receivers.shutdown(wait=True)
        self._sock.close()

    # --- the event loop's thread -------------------------------------------------
    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._main = self._loop.create_task(self._serve_all())
        self._loop.call_soon(started.set)
        try:
            self._loop.run_until_complete(self._main)
        except asyncio.CancelledError:
            pass
        finally:
            self._loop.close()

    async def _serve_all(self) -> None:
        loop = asyncio.get_running_loop()
        serving: set[asyncio.Task] = set()
        try:
            while True:
                try:
                    conn, peer = await loop.sock_accept(self._sock)
                except OSError as e:  # out of file descriptors, say: the others go on
                    log.warning("TCP transfer listener %s: accept failed: %s", self.address, e)
                    await asyncio.sleep(0.1)
                    continue
                if len(self._conns) >= self.max_connections:
                    self._refuse_connection(conn, peer)
                    continue
                self.accepted += 1
                self._conns.add(conn)
                task = loop.create_task(self._serve(conn, peer))
                serving.add(task)
                task.add_done_callback(serving.discard)
        finally:
            for conn in list(self._conns):  # wakes a receiving thread at once
                _shutdown(conn)
            if serving:
                _, late = await asyncio.wait(serving, timeout=CLOSE_WAIT_SECONDS)
                for task in late:
                    task.cancel()

    def _refuse_connection(self, conn: socket.socket, peer) -> None:
        self.refused_connections += 1
        self.metrics.refused.labels(Refusal.TOO_MANY).inc()
        if self.refused_connections == 1 or self.refused_connections % 100 == 0:
            log.warning("TCP transfer listener %s: %d connections open, closed one from %s (%d so far)",
                        self.address, len(self._conns), peer[0], self.refused_connections)  # fmt: skip
        try:
            conn.send(bytes([Status.BUSY]))
        except OSError:
            pass
        conn.close()

    async def _serve(self, conn: socket.socket, peer) -> None:
        """Transfers on one connection, one after another, until one fails or it idles."""
        loop = asyncio.get_running_loop()
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                secured = await self._secure(conn, peer)
                if secured is None:
                    return
                conn = secured
            first = True
            while True:
                ticket = await self._greeting(conn, peer, first)
                if ticket is None:
                    return
                await _send_all(conn, bytes([Status.OK]))
                status = await loop.run_in_executor(self._receivers, self._receive, conn, ticket, peer)
                if status != Status.OK:
                    return
                first = False
        except OSError as e:
            log.info("TCP transfer connection from %s ended: %s", peer[0], e)
        finally:
            self._conns.discard(conn)
            conn.close()

    async def _secure(self, conn: socket.socket, peer) -> SealedSocket | None:
        """``conn`` sealed under keys agreed in a TLS session whose peer the CA certified;
        None (``conn`` closed) if not."""
        try:
            async with asyncio.timeout(HANDSHAKE_SECONDS):
                opening = await _io(conn, lambda: conn.recv(len(MAGIC), socket.MSG_PEEK))
        except (TimeoutError, OSError):
            opening = b""
        if not opening or opening[0] != TLS_RECORD:
            if opening and MAGIC.startswith(opening):  # a sender without TLS: tell it why, in clear
                await self._refuse(conn, peer, Refusal.TLS_MISMATCH, "a sender without TLS",
                                   status=Status.TLS_REQUIRED)  # fmt: skip
            elif opening:
                await self._refuse(conn, peer, Refusal.BAD_GREETING, "no TLS handshake")
            self._conns.discard(conn)
            conn.close()
            return None
        secured = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        self._conns.discard(conn)  # ``conn`` is now detached: its socket is ``secured``'s
        self._conns.add(secured)
        message = bytearray(EXCHANGE_BYTES)
        try:
            async with asyncio.timeout(HANDSHAKE_SECONDS):
                await _io(secured, secured.do_handshake)
                await _recv_exact(secured, memoryview(message))  # the sender's secret, then ours
                theirs = peer_secret(bytes(message), "sender")
                mine = new_secret()
                await _send_all(secured, exchange_message(mine))
        except (TimeoutError, OSError, EOFError) as e:
            log.warning("refused a TCP transfer connection from %s:%s: %s: %s",
                        peer[0], peer[1], Refusal.TLS_HANDSHAKE.text, e)  # fmt: skip
            self.metrics.refused.labels(Refusal.TLS_HANDSHAKE).inc()
            self._conns.discard(secured)
            secured.close()
            return None
        self._conns.discard(secured)
        sealed = seal_receiver(secured, theirs, mine)
        self._conns.add(sealed)
        return sealed

    async def _greeting(self, conn: socket.socket, peer, first: bool) -> OpenTicket | None:
        """The next greeting's ticket; None when the connection is to be closed."""
        hello = bytearray(len(MAGIC) + GREETING.size)
        view = memoryview(hello)
        try:
            async with asyncio.timeout(self.idle_timeout):
                await _recv_exact(conn, view[: len(MAGIC)])
                if hello[: len(MAGIC)] != MAGIC:
                    if first and hello[0] == TLS_RECORD:  # a TLS sender; this listener has none
                        return await self._refuse(conn, peer, Refusal.TLS_MISMATCH, "a TLS sender, and no TLS here")
                    return await self._refuse(conn, peer, Refusal.BAD_GREETING, Refusal.BAD_GREETING.text)
                await _recv_exact(conn, view[len(MAGIC) :])
        except TimeoutError:
            self.metrics.idle_closed.inc()
            log.debug("closed a TCP transfer connection from %s, idle for %gs", peer[0], self.idle_timeout)
            return None
        except (OSError, EOFError) as e:
            if first:
                log.warning("TCP transfer from %s: no greeting (%s)", peer[0], e)
            return None  # a reused connection the sender closed: nothing to report
        tid, nonce, proof = GREETING.unpack_from(hello, len(MAGIC))
        ticket = self.tickets.get(tid)
        reason = Refusal.UNKNOWN if ticket is None else ticket.admit(nonce, proof)
        if reason is not None:
            return await self._refuse(conn, peer, reason, f"ticket {tid.hex()[:8]}: {reason.text}")
        return ticket

    async def _refuse(
        self, conn: socket.socket, peer, reason: Refusal, what: str, status: Status = Status.REFUSED
    ) -> None:
        log.warning("refused a TCP transfer from %s:%s: %s", peer[0], peer[1], what)
        self.metrics.refused.labels(reason).inc()
        try:
            await _send_all(conn, bytes([status]))
        except OSError:
            pass
        return None

    # --- a receiving thread --------------------------------------------------------
    def _receive(self, conn: socket.socket, ticket: OpenTicket, peer) -> Status:
        """One greeted transfer's frames, then its status; blocking, on a pooled thread."""
        try:
            if failpoints.active("transfer.stall_receive") or failpoints.first_time("transfer.stall_first_receive"):
                log.warning("failpoint: not reading from %s", peer[0])
                self._closing.wait(ticket.expires_at - self.tickets.clock())
                return Status.FAILED
            status = self._receive_frames(conn, ticket, peer)
            try:
                conn.settimeout(self.idle_timeout)
                conn.sendall(bytes([status]))
            except OSError:
                return Status.FAILED
            return status
        finally:
            try:
                conn.setblocking(False)  # back to the event loop
            except OSError:
                pass

    def _receive_frames(self, conn: socket.socket, ticket: OpenTicket, peer) -> Status:
        header = bytearray(FRAME.size)
        try:
            while True:
                # every wait is bounded by the idle timeout and by the ticket's expiry
                remaining = ticket.expires_at - self.tickets.clock()
                conn.settimeout(max(0.1, min(self.idle_timeout, remaining)))
                _recv_exact_blocking(conn, memoryview(header))
                offset, length = FRAME.unpack(header)
                if offset == END_OFFSET:
                    return Status.OK
                reason = ticket.reserve(offset, length)
                if reason is not None:
                    log.warning("refused a frame from %s: [%d, +%d) %s", peer[0], offset, length, reason.text)
                    self.metrics.refused.labels(reason).inc()
                    return Status.BAD_FRAME
                _recv_exact_blocking(conn, ticket.view[offset : offset + length])
                ticket.arrived(offset, length)
                self.metrics.received.inc(length)
        except EOFError as e:
            ticket.failed = ErrorCode.TRUNCATED
            log.warning("TCP transfer from %s truncated: %s", peer[0], e)
            return Status.SHORT
        except TimeoutError:
            ticket.failed = ErrorCode.TIMEOUT
            return Status.FAILED
        except SealError as e:
            ticket.failed = ErrorCode.TLS
            log.warning("TCP transfer from %s: %s; connection closed", peer[0], e)
            return Status.FAILED
        except OSError as e:
            ticket.failed = ErrorCode.PEER_GONE
            log.warning("TCP transfer from %s broke: %s", peer[0], e)
            return Status.FAILED


async def _io(conn: socket.socket, op: Callable[[], T], writing: bool = False) -> T:
    """``op`` on a non-blocking socket, plain or TLS, waiting on the event loop while it would
    block (asyncio's ``sock_*`` methods take no TLS socket). A TLS read may need to write
    (and the other way round): the error says which to wait for."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return op()
        except ssl.SSLWantReadError:
            await _ready(conn, loop.add_reader, loop.remove_reader)
        except ssl.SSLWantWriteError:
            await _ready(conn, loop.add_writer, loop.remove_writer)
        except BlockingIOError:
            if writing:
                await _ready(conn, loop.add_writer, loop.remove_writer)
            else:
                await _ready(conn, loop.add_reader, loop.remove_reader)


async def _ready(conn: socket.socket, add: Callable, remove: Callable) -> None:
    fd = conn.fileno()
    ready = asyncio.get_running_loop().create_future()
    add(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        remove(fd)


async def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = await _io(conn, lambda: conn.recv_into(view[got:]))
        if n == 0:
            raise EOFError(f"stream ended after {got} of {len(view)} bytes")
        got += n


async def _send_all(conn: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[await _io(conn, lambda: conn.send(view), writing=True) :]


def _recv_exact_blocking(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError(f"stream ended after {got} of {len(view)} bytes")
        got += n


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
