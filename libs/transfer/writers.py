"""What every transport's writer is: it streams spans of a local segment into one
ticket's destination on pooled threads, so a producer (a prefill computing layer
after layer) hands it work without waiting and the wire overlaps the compute. It ends
in `finish()`, which returns once every byte is at the destination or raises a
TransferError naming why not. The transports' writers (`shm.py`, `tcp/`) say only
how one piece of work is done.

Each writer has one or more *lanes*: a queue of work done in order by one thread at a
time of the engine's pool. No thread is started per transfer (a thread start costs
more than copying 64 KiB).
"""

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor

from libs.protocol.vocabulary import ErrorCode
from libs.transfer.descriptors import Span, TransferError
from libs.transfer.segment import SharedSegment

# Threads are made on demand and reused when idle; the cap only bounds a pathological
# number of transfers at once (a stalled TCP lane holds its thread until its deadline).
MAX_LANE_THREADS = 64


class Lane:
    """Work done in submission order by one pooled thread at a time."""

    def __init__(self, writer: "Writer") -> None:
        self.writer = writer
        self.pending: deque = deque()
        self.running = False
        self.connection = None  # what a transport keeps per lane (a TCP connection)

    def put(self, item) -> None:
        with self.writer._lock:
            self.pending.append(item)
            if self.running:
                return
            self.running = True
            self.writer._busy += 1
            self.writer._idle.clear()
        try:
            self.writer.pool.submit(self._drain)
        except RuntimeError:  # the engine closed its pool: nothing of this transfer runs again
            self.writer._fail(TransferError(ErrorCode.CANCELLED, "the transfer engine is closed"))
            with self.writer._lock:
                self.pending.clear()
                self.running = False
                self.writer._lane_idle()

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
                self.writer._fail(TransferError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))


class Writer:
    """Spans from ``source`` to one ticket's destination; a transport's writer says, in
    `submit` and `_process`, how they get there."""

    transport = ""  # the transport's name: the label of its metrics

    def __init__(self, source: SharedSegment, timeout: float, pool: Executor) -> None:
        self.source = source
        self.pool = pool  # the engine's threads, which run the lanes
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
        self._lanes: list[Lane] = []

    def submit(self, spans: list[Span]) -> None:
        """Queue spans to send; returns at once."""
        raise NotImplementedError

    def _process(self, lane: Lane, item) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Stop as soon as possible; finish() then raises."""
        self._fail(TransferError(ErrorCode.CANCELLED, "transfer aborted"))

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
            raise TransferError(ErrorCode.TIMEOUT, f"not finished within {self.timeout:g}s")

    def finish_sync(self) -> None:
        self._end()
        if not self._idle.wait(max(0.0, self.deadline - time.monotonic())):
            self._fail(TransferError(ErrorCode.TIMEOUT, f"not finished within {self.timeout:g}s"))
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
            self._fail(TransferError(ErrorCode.TIMEOUT, f"not finished within {self.timeout:g}s"))
            self.abort()
        if self.error is not None:
            raise self.error


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class SerialWriter(Writer):
    """Spans sent in submission order, one batch at a time, by ``send`` on one lane: all
    a transport that can copy a batch of spans needs for its writer."""

    def __init__(
        self, source: SharedSegment, timeout: float, pool: Executor, transport: str, send: Callable[[list[Span]], None]
    ) -> None:
        super().__init__(source, timeout, pool)
        self.transport = transport
        self.send = send
        self._lane = Lane(self)
        self._lanes.append(self._lane)

    def submit(self, spans: list[Span]) -> None:
        self._lane.put(spans)

    def _process(self, lane: Lane, spans) -> None:
        if self.error is not None:
            return
        self._check_deadline()
        self.send(spans)
        self._count(sum(s.length for s in spans))

