"""Writers stream spans of a local segment into one ticket's destination on pooled
threads, so a producer (a prefill computing layer after layer) hands them work
without waiting and the wire overlaps the compute.

`ShmWriter` copies into a peer's shared-memory segment on this host;
`TcpWriter` slices spans and sends them over a few parallel connections, opened
(or taken from the idle pool, see `tcp.py`) only as the slices need them.
Both end in `finish()`, which returns once every byte is at the destination
or raises a TransferError naming why not.

Each writer has one or more *lanes*: a queue of work done in order by one pooled
thread at a time. No thread is started per transfer (a thread start costs more than
copying 64 KiB), and a shm copy with nothing queued before it is done at once on the
caller's thread when that is no event loop's thread or the copy is small.
"""

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from libs.common.schema import WriteTicket
from libs.common.transfer.descriptors import CANCELLED, TIMEOUT, Span, TransferError, split_spans
from libs.common.transfer.segment import SharedSegment
from libs.common.transfer.tcp import TcpConnection, new_nonces

_DONE = object()  # a lane's last item: TCP sends its end frame and waits for the receiver's status
VECTORIZE_BELOW = 256 << 10  # spans smaller than this are copied with one gather/scatter per batch
# A shm submit with nothing queued before it is copied on the caller's thread when that
# thread runs no event loop (a prefill's compute thread: a pooled thread would cost the
# same CPU plus a hand-off), or when it is this small (about 100 us of copying, less
# than handing it to a thread and being woken when it is done).
INLINE_BELOW = 1 << 20

# Threads are made on demand and reused when idle; the cap only bounds a pathological
# number of transfers at once (a stalled TCP lane holds its thread until its deadline).
_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kv-writer")


class _Lane:
    """Work done in submission order by one pooled thread at a time."""

    def __init__(self, writer: "Writer") -> None:
        self.writer = writer
        self.pending: deque = deque()
        self.running = False
        self.connection: TcpConnection | None = None  # TCP lanes only

    def put(self, item) -> None:
        with self.writer._lock:
            self.pending.append(item)
            if self.running:
                return
            self.running = True
            self.writer._busy += 1
            self.writer._idle.clear()
        _POOL.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self.writer._lock:
                if not self.pending:
                    self.running = False
                    self.writer._lane_idle()
                    return
                item = self.pending.popleft()
            try:
                self.writer._process(self, item)
            except TransferError as e:
                self.writer._fail(e)
            except Exception as e:  # a bug must not leave finish() waiting
                self.writer._fail(TransferError("internal", f"{type(e).__name__}: {e}"))


class Writer:
    transport = ""

    def __init__(self, source: SharedSegment, timeout: float) -> None:
        self.source = source
        self.started_at = time.monotonic()
        self.deadline = self.started_at + timeout
        self.timeout = timeout
        self.bytes = 0
        self.error: TransferError | None = None
        self._lock = threading.Lock()
        self._busy = 0  # lanes with work queued or running
        self._idle = threading.Event()
        self._idle.set()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._lanes: list[_Lane] = []

    def submit(self, spans: list[Span]) -> None:
        """Queue spans to send; returns at once."""
        raise NotImplementedError

    def _process(self, lane: _Lane, item) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Stop as soon as possible; finish() then raises."""
        self._fail(TransferError(CANCELLED, "transfer aborted"))

    def _fail(self, error: TransferError) -> None:
        if self.error is None:
            self.error = error

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes += n

    def _lane_idle(self) -> None:  # called with the lock held
        self._busy -= 1
        if self._busy == 0:
            self._idle.set()
            for loop, future in self._waiters:
                loop.call_soon_threadsafe(_resolve, future)
            self._waiters.clear()

    def _end(self) -> None:
        """Called once by finish: queue what closes each lane."""

    def _check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            raise TransferError(TIMEOUT, f"not finished within {self.timeout:g}s")

    def finish_sync(self) -> None:
        self._end()
        if not self._idle.wait(max(0.0, self.deadline - time.monotonic())):
            self._fail(TransferError(TIMEOUT, f"not finished within {self.timeout:g}s"))
            self.abort()
        if self.error is not None:
            raise self.error

    async def finish(self) -> None:
        self._end()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._busy:
                self._waiters.append((loop, future))
            else:
                future.set_result(None)
        try:
            await asyncio.wait_for(future, max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            self._fail(TransferError(TIMEOUT, f"not finished within {self.timeout:g}s"))
            self.abort()
        if self.error is not None:
            raise self.error


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class ShmWriter(Writer):
    transport = "shm"

    def __init__(self, source: SharedSegment, destination: SharedSegment, timeout: float) -> None:
        super().__init__(source, timeout)
        self.destination = destination
        self._lane = _Lane(self)
        self._lanes.append(self._lane)

    def submit(self, spans: list[Span]) -> None:
        with self._lock:
            queued = self._lane.running
        if not queued and (not _on_event_loop() or sum(s.length for s in spans) < INLINE_BELOW):
            try:
                self._process(self._lane, spans)
            except TransferError as e:
                self._fail(e)
            return
        self._lane.put(spans)

    def _process(self, lane: _Lane, spans) -> None:
        if self.error is not None:
            return
        self._check_deadline()
        copy_spans(self.source.tensor, self.destination.tensor, spans)
        self._count(sum(s.length for s in spans))


def copy_spans(src: torch.Tensor, dst: torch.Tensor, spans: list[Span]) -> None:
    """Copy spans between two flat uint8 tensors: one gather/scatter when the spans
    are small, equal and aligned to their length (layer-wise slices of blocks),
    else one copy per span."""
    if not spans:
        return
    n = spans[0].length
    uniform = n < VECTORIZE_BELOW and len(spans) > 4 and all(
        s.length == n and s.src_offset % n == 0 and s.dst_offset % n == 0 for s in spans
    )
    if uniform:
        src_rows = src[: src.numel() // n * n].view(-1, n)
        dst_rows = dst[: dst.numel() // n * n].view(-1, n)
        src_index = torch.tensor([s.src_offset // n for s in spans])
        dst_index = torch.tensor([s.dst_offset // n for s in spans])
        dst_rows.index_copy_(0, dst_index, src_rows.index_select(0, src_index))
        return
    for s in spans:
        dst[s.dst_offset : s.dst_offset + s.length].copy_(src[s.src_offset : s.src_offset + s.length])


class TcpWriter(Writer):
    transport = "tcp"

    def __init__(
        self, source: SharedSegment, ticket: WriteTicket, timeout: float, connections: int, slice_bytes: int
    ) -> None:
        super().__init__(source, timeout)
        if not ticket.address:
            raise TransferError("peer_gone", (
                f"the receiver on host {ticket.host_id!r} gave no TCP address: it has no listener, or issued the "
                f"ticket for a shared-memory writer on its host (processes that share a KVSERVE_HOST_ID must share "
                f"/dev/shm)"))  # fmt: skip
        self.ticket = ticket
        self.nonces = new_nonces()  # one greeting nonce per connection of this transfer
        self.slice_bytes = slice_bytes
        self.max_lanes = max(1, connections)
        self._next = 0
        self._ended = False

    def submit(self, spans: list[Span]) -> None:
        # Slices go round-robin over the lanes (one connection each, opened when a lane
        # first gets work); each lane keeps its order, so a layer submitted before
        # another completes before it.
        for span in split_spans(spans, self.slice_bytes):
            if self._next == len(self._lanes):
                self._lanes.append(_Lane(self))
            self._lanes[self._next].put([span])
            self._next = (self._next + 1) % self.max_lanes

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            for lane in self._lanes:
                lane.put(_DONE)

    def _process(self, lane: _Lane, item) -> None:
        if item is _DONE:
            connection, lane.connection = lane.connection, None
            if connection is None:
                return
            if self.error is not None:  # the transfer failed elsewhere: this connection is not reused
                connection.close()
                return
            try:
                connection.finish()  # the end frame and the receiver's status; then pooled again
            except TransferError:
                connection.close()
                raise
            return
        if self.error is not None:
            return
        try:
            if lane.connection is None:
                lane.connection = TcpConnection(self.ticket.address, self.ticket.token, self.deadline,
                                                nonces=self.nonces)  # fmt: skip
            lane.connection.send(self.source.view, item)
        except TransferError:
            if lane.connection is not None:
                lane.connection.close()
                lane.connection = None
            raise
        self._count(sum(s.length for s in item))
