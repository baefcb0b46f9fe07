"""The shared-memory transport: a sender on the receiver's host maps the receiver's
segment (under /dev/shm) and copies into it. Nothing listens, and a ticket for such a
sender carries no address.
"""

import asyncio
from concurrent.futures import Executor

import torch

from libs.protocol.schema import WriteTicket
from libs.protocol.vocabulary import ErrorCode
from libs.transfer.descriptors import Span, TransferError
from libs.transfer.segment import SHM_DIR, SharedSegment
from libs.transfer.transport import Transport
from libs.transfer.writers import SerialWriter, Writer

VECTORIZE_BELOW = 256 << 10  # spans smaller than this are copied with one gather/scatter per batch
# A submit with nothing queued before it is copied on the caller's thread when that
# thread runs no event loop (a prefill's compute thread: a pooled thread would cost the
# same CPU plus a hand-off), or when it is this small (about 100 us of copying, less
# than handing it to a thread and being woken when it is done).
INLINE_BELOW = 1 << 20


class ShmTransport(Transport):
    name = "shm"
    same_host_only = True

    def can_reach(self, ticket: WriteTicket) -> bool:
        return ticket.host_id == self.host.host_id and (SHM_DIR / ticket.segment).exists()

    def make_writer(self, ticket: WriteTicket, source: SharedSegment, timeout: float) -> Writer:
        destination = self.host.segment(ticket.segment)
        self.host.claim(ticket)
        return ShmWriter(source, destination, timeout, self.host.pool)


class ShmWriter(SerialWriter):
    """Copies into a peer's segment mapped here; at once on the caller's thread when
    nothing is queued before it and the caller is no event loop (or the copy is small)."""

    def __init__(self, source: SharedSegment, destination: SharedSegment, timeout: float, pool: Executor) -> None:
        super().__init__(source, timeout, pool, ShmTransport.name, self._copy)
        self.destination = destination

    def _copy(self, spans: list[Span]) -> None:
        destination = self.destination.tensor
        if destination is None:  # unmapped: its owner is gone (TransferEngine.forget_gone)
            raise TransferError(ErrorCode.PEER_GONE, f"segment {self.destination.name} is gone")
        copy_spans(self.source.tensor, destination, spans)

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


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
