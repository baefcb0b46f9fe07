"""Writers stream spans of a local segment into one ticket's destination, from
their own threads, so a producer (a prefill computing layer after layer) hands
them work without waiting and the wire overlaps the compute.

`ShmWriter` copies into a peer's shared-memory segment on this host;
`TcpWriter` slices spans and sends them over a few parallel connections.
Both end in `finish()`, which returns once every byte is at the destination
or raises a TransferError naming why not.
"""

import asyncio
import queue
import threading
import time
from collections.abc import Callable

import torch

from libs.common.schema import WriteTicket
from libs.common.transfer.descriptors import CANCELLED, TIMEOUT, Span, TransferError, split_spans
from libs.common.transfer.segment import SharedSegment
from libs.common.transfer.tcp import TcpConnection

_DONE = object()
VECTORIZE_BELOW = 256 << 10  # spans smaller than this are copied with one gather/scatter per batch


class Writer:
    transport = ""

    def __init__(self, source: SharedSegment, timeout: float) -> None:
        self.source = source
        self.started_at = time.monotonic()
        self.deadline = self.started_at + timeout
        self.timeout = timeout
        self.bytes = 0
        self._bytes_lock = threading.Lock()
        self.error: TransferError | None = None
        self._threads: list[threading.Thread] = []

    def submit(self, spans: list[Span]) -> None:
        """Queue spans to send; returns at once."""
        raise NotImplementedError

    def _close_queues(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Stop as soon as possible; finish() then raises."""
        self._fail(TransferError(CANCELLED, "transfer aborted"))

    def _fail(self, error: TransferError) -> None:
        if self.error is None:
            self.error = error

    def finish_sync(self) -> None:
        self._close_queues()
        for thread in self._threads:
            thread.join(max(0.0, self.deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            self._fail(TransferError(TIMEOUT, f"not finished within {self.timeout:g}s"))
            self.abort()
        if self.error is not None:
            raise self.error

    async def finish(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.finish_sync)

    def _start(self, target: Callable[..., None], *args) -> None:
        thread = threading.Thread(target=target, args=args, name=f"{self.transport}-writer", daemon=True)
        self._threads.append(thread)
        thread.start()


class ShmWriter(Writer):
    transport = "shm"

    def __init__(self, source: SharedSegment, destination: SharedSegment, timeout: float) -> None:
        super().__init__(source, timeout)
        self.destination = destination
        self._queue: queue.Queue = queue.Queue()
        self._start(self._run)

    def submit(self, spans: list[Span]) -> None:
        self._queue.put(spans)

    def _close_queues(self) -> None:
        self._queue.put(_DONE)

    def _run(self) -> None:
        while (spans := self._queue.get()) is not _DONE:
            if self.error is not None:
                continue
            if time.monotonic() > self.deadline:
                self._fail(TransferError(TIMEOUT, f"not finished within {self.timeout:g}s"))
                continue
            copy_spans(self.source.tensor, self.destination.tensor, spans)
            self.bytes += sum(s.length for s in spans)


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
            raise TransferError("peer_gone", "the receiver has no TCP address")
        self.slice_bytes = slice_bytes
        self._queues = [queue.Queue() for _ in range(max(1, connections))]
        self._next = 0
        for q in self._queues:
            self._start(self._run, ticket, q)

    def submit(self, spans: list[Span]) -> None:
        # Slices go round-robin over the connections; each connection keeps its order,
        # so a layer submitted before another completes before it.
        for span in split_spans(spans, self.slice_bytes):
            self._queues[self._next].put([span])
            self._next = (self._next + 1) % len(self._queues)

    def _close_queues(self) -> None:
        for q in self._queues:
            q.put(_DONE)

    def _run(self, ticket: WriteTicket, work: queue.Queue) -> None:
        connection = None
        try:
            connection = TcpConnection(ticket.address, ticket.token, self.deadline)
            while (spans := work.get()) is not _DONE:
                if self.error is not None:
                    raise self.error
                connection.send(self.source.view, spans)
                with self._bytes_lock:
                    self.bytes += sum(s.length for s in spans)
            connection.finish()
        except TransferError as e:
            self._fail(e)
            if connection is not None:
                connection.close()
            while work.get() is not _DONE:  # drain, so finish() is not left waiting
                pass
