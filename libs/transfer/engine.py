"""The transfer engine: registered segments, tickets, and transfers between them.

A receiver registers its segments and, per transfer, issues a `WriteTicket`
for the ranges a sender may fill (``expect``). A sender opens a writer on that
ticket (``writer`` / ``write``) through the first transport of `registry.py`
that reaches the receiver — shared memory when it is on this host, TCP otherwise —
or the one ``transport`` names; the same interface either way, the design of
Mooncake's Transfer Engine. The engine knows transports only as `Transport`s, and
owns what they share: the tickets and the threads that run writers. Every
transfer has a deadline and ends in success or a TransferError with a cause; the
engine counts bytes, transfers, durations and failures per transport.
"""

import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from libs.common.metrics import Metrics
from libs.common.tls import TlsFiles
from libs.protocol.schema import WriteTicket
from libs.protocol.vocabulary import ErrorCode
from libs.transfer.descriptors import Descriptor, Span, TransferError
from libs.transfer.ranges import RangeSet
from libs.transfer.registry import TRANSPORTS
from libs.transfer.segment import SHM_DIR, SharedSegment
from libs.transfer.shm import ShmTransport, copy_spans
from libs.transfer.tickets import OpenTicket, TicketBook, claim, ticket_id
from libs.transfer.transfer_metrics import TransferMetrics
from libs.transfer.transport import Transport
from libs.transfer.writers import MAX_LANE_THREADS, Writer

AUTO = "auto"  # the first transport that reaches the receiver


class TransferEngine:
    def __init__(
        self,
        host_id: str = "",
        *,
        listen: str | None = None,
        transport: str = AUTO,
        connections: int = 4,
        slice_bytes: int = 4 << 20,
        timeout: float = 30.0,
        max_connections: int = 64,
        idle_timeout: float = 60.0,
        tls: TlsFiles | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """``listen`` ("host:port", port 0 for any): where a TCP listener binds, so peers on
        other hosts can write here, once one may (see `expect`); ``transport`` forces one
        transport (a name in `registry.TRANSPORTS`) for sending, and one that reaches other
        hosts is opened for receiving at once. The listener serves at most
        ``max_connections`` connections and closes those idle ``idle_timeout`` seconds.
        ``tls``: mutual TLS on TCP, both ways (`tcp/tls.py`); None: plain TCP.
        ``metrics``: the process's, where the engine counts (a private set when None)."""
        if transport != AUTO and transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {(AUTO, *TRANSPORTS)}, got {transport!r}")
        self.host_id = host_id
        self.transport = transport
        self.connections = connections
        self.slice_bytes = slice_bytes
        self.timeout = timeout
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.listen = listen
        self.tls = tls
        self.tickets = TicketBook()
        self.pool = ThreadPoolExecutor(max_workers=MAX_LANE_THREADS, thread_name_prefix="kv-writer")
        self._segments: dict[str, SharedSegment] = {}
        self._local: set[str] = set()
        self._lock = threading.Lock()
        self.metrics = TransferMetrics(metrics, list(TRANSPORTS))
        self.transports: dict[str, Transport] = {name: kind(self) for name, kind in TRANSPORTS.items()}
        forced = self.transports.get(transport)
        # sending only through a transport that reaches other hosts: receive through it from the start
        self._sends_off_host = forced is not None and not forced.same_host_only
        if self._sends_off_host:
            forced.open_receiver()

    @property
    def writer_host_id(self) -> str | None:
        """What to tell a receiver about to issue us a ticket: our host id, or None when we
        send only through a transport that reaches other hosts (so the receiver listens)."""
        return None if self._sends_off_host else self.host_id

    def _open_receivers(self) -> str | None:
        """The address a ticket gives a sender that may be on another host, if any."""
        for transport in self.transports.values():
            if not transport.same_host_only and (address := transport.open_receiver()) is not None:
                return address
        return None

    # --- segments ------------------------------------------------------------
    def register(self, segment: SharedSegment) -> None:
        """Make one of this process's own segments available to transfers."""
        with self._lock:
            self._segments[segment.name] = segment
            self._local.add(segment.name)

    def segment(self, name: str) -> SharedSegment:
        """A registered segment, or a peer's on this host (mapped once, then reused). Mapping
        a new one first unmaps the peers' segments whose names are gone: their owners died or
        stopped (a restarted worker's pool has a new name), and each mapping holds the dead
        pool's memory for as long as it lasts."""
        with self._lock:
            segment = self._segments.get(name)
        if segment is None:
            self.forget_gone()
            try:
                segment = SharedSegment.attach(name)
            except (OSError, ValueError) as e:
                raise TransferError(ErrorCode.PEER_GONE, f"cannot open segment {name}: {e}") from e
            with self._lock:
                segment = self._segments.setdefault(name, segment)
        return segment

    def forget_gone(self) -> list[str]:
        """Unmap every peer's segment whose name no longer exists under /dev/shm; their names."""
        with self._lock:
            peers = [name for name in self._segments if name not in self._local]
        gone = [name for name in peers if not (SHM_DIR / name).exists()]
        for name in gone:
            self.forget(name)
        return gone

    def forget(self, name: str) -> None:
        """Drop a peer's mapping (e.g. when the peer left the cluster)."""
        with self._lock:
            segment = None if name in self._local else self._segments.pop(name, None)
        if segment is not None:
            segment.close()

    # --- receiving -------------------------------------------------------------
    def expect(
        self, segment: str, ranges: Sequence[tuple[int, int]], ttl: float, sender_host: str | None = None
    ) -> WriteTicket:
        """Issue a one-time ticket letting one sender write ``ranges`` of ``segment`` (each
        byte once) for ``ttl`` seconds. ``sender_host``: the sender's host id, if known
        (its `writer_host_id`); a sender on this host writes through shared memory, so
        its ticket has no address and no listener is opened for it."""
        local = self._segments[segment]
        token = secrets.token_hex(16)
        on_this_host = bool(sender_host) and sender_host == self.host_id and not self._sends_off_host
        address = None if on_this_host else self._open_receivers()
        ticket = OpenTicket(token, segment, local.view, RangeSet(list(ranges)), time.monotonic() + ttl,
                            tcp=address is not None)  # fmt: skip
        self.tickets.open(ticket)
        return WriteTicket(token=token, host_id=self.host_id, segment=segment, address=address)

    def close_ticket(self, token: str) -> OpenTicket | None:
        """Stop accepting writes on a ticket (done, cancelled or expired); return its record."""
        return self.tickets.close(token)

    # --- sending ---------------------------------------------------------------
    def choose_transport(self, ticket: WriteTicket) -> str:
        """The name of the transport a writer on ``ticket`` goes through."""
        if self.transport != AUTO:
            return self.transport
        for transport in self.transports.values():
            if transport.can_reach(ticket):
                return transport.name
        raise TransferError(ErrorCode.PEER_GONE, f"no transport reaches host {ticket.host_id!r}")

    def writer(self, ticket: WriteTicket, source: str, timeout: float | None = None) -> Writer:
        """Open a streaming writer from our segment ``source`` to the ticket's destination."""
        timeout = self.timeout if timeout is None else timeout
        src = self.segment(source)
        return self.transports[self.choose_transport(ticket)].make_writer(ticket, src, timeout)

    def claim(self, ticket: WriteTicket) -> None:
        """Take ``ticket`` for a shared-memory write (``writer`` does; call it before a
        plain ``copy`` into a ticket's ranges), so no TCP greeting can use it too."""
        if ticket.address is None:
            return  # issued for shared memory only: the receiver refuses it over TCP anyway
        try:
            taken = claim(ticket.segment, ticket_id(ticket.token))
        except OSError as e:
            raise TransferError(ErrorCode.PEER_GONE, f"cannot claim a ticket of {ticket.segment}: {e}") from e
        if not taken:
            self.metrics.failures.labels(ShmTransport.name, ErrorCode.BAD_TOKEN).inc()
            raise TransferError(ErrorCode.BAD_TOKEN, f"a ticket of {ticket.segment} was already used by another writer")

    async def finish(self, writer: Writer) -> None:
        """Wait until every byte ``writer`` was given is at its destination; count it."""
        try:
            await writer.finish()
        except TransferError as e:
            self.metrics.failures.labels(writer.transport, e.cause).inc()
            raise
        self.metrics.succeeded(writer.transport, writer.bytes, time.monotonic() - writer.started_at)

    async def abort(self, writer: Writer) -> None:
        """Stop a writer whose transfer is no longer wanted, and wait for its threads."""
        writer.abort()
        try:
            await writer.finish()
        except TransferError:
            pass

    @asynccontextmanager
    async def writing(self, ticket: WriteTicket, source: str, timeout: float | None = None):
        """``async with engine.writing(ticket, src) as w: w.submit(spans)...`` — waits for
        every byte on exit, and aborts the writer if the body fails."""
        writer = self.writer(ticket, source, timeout)
        try:
            yield writer
        except BaseException:
            await self.abort(writer)
            raise
        await self.finish(writer)

    async def write(self, ticket: WriteTicket, source: str, spans: list[Span], timeout: float | None = None) -> None:
        """Write ``spans`` of ``source`` through the ticket and wait until they are there."""
        async with self.writing(ticket, source, timeout) as writer:
            writer.submit(spans)

    # --- copies inside this process --------------------------------------------
    def copy(self, batch: Sequence[Descriptor]) -> None:
        """Copy between segments mapped here (e.g. the store's pool and a worker's), blocking."""
        by_pair: dict[tuple[str, str], list[Span]] = {}
        for d in batch:
            for name, offset in ((d.src_segment, d.src_offset), (d.dst_segment, d.dst_offset)):
                segment = self.segment(name)
                if offset < 0 or d.length < 0 or offset + d.length > segment.nbytes:
                    raise TransferError(ErrorCode.BAD_RANGE, f"[{offset}, {offset + d.length}) is outside {name}")
            by_pair.setdefault((d.src_segment, d.dst_segment), []).append(Span(d.src_offset, d.dst_offset, d.length))
        start = time.perf_counter()
        for (src, dst), spans in by_pair.items():
            copy_spans(self.segment(src).tensor, self.segment(dst).tensor, spans)
        if batch:
            self.metrics.succeeded(ShmTransport.name, sum(d.length for d in batch), time.perf_counter() - start)

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()
        self.pool.shutdown(wait=False)  # a lane still running ends at its transfer's deadline
        self.tickets.close_all()
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
            local, self._local = self._local, set()
        for name in local:  # claims a late shared-memory writer made after its ticket closed
            for path in SHM_DIR.glob(f"{name}.claim-*"):
                path.unlink(missing_ok=True)
        for segment in segments:
            segment.close()
