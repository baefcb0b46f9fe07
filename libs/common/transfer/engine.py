"""The transfer engine: registered segments and asynchronous batch transfers.

A worker registers its own segments and opens its peers' by name; a transfer
is a batch of descriptors, checked against segment bounds, executed off the
event loop, and awaited with a timeout. Today's transport is a memory copy
between shared-memory segments on one host; the interface is what a TCP or
RDMA transport would implement too.
"""

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from libs.common.transfer.descriptors import Descriptor, TransferError
from libs.common.transfer.segment import SharedSegment

log = logging.getLogger(__name__)


class TransferEngine:
    def __init__(self, executor: ThreadPoolExecutor | None = None) -> None:
        self._segments: dict[str, SharedSegment] = {}
        self._local: set[str] = set()
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="transfer")
        self.bytes_moved = 0
        self.transfers = 0

    def register(self, segment: SharedSegment) -> None:
        """Make one of this process's own segments available to transfers."""
        self._segments[segment.name] = segment
        self._local.add(segment.name)

    def open(self, name: str) -> SharedSegment:
        """Map a peer's segment (once; later calls reuse the mapping)."""
        segment = self._segments.get(name)
        if segment is None:
            try:
                segment = SharedSegment.attach(name)
            except (OSError, ValueError) as e:
                raise TransferError("peer_gone", f"cannot open segment {name}: {e}") from e
            self._segments[name] = segment
        return segment

    def forget(self, name: str) -> None:
        """Drop a peer's mapping (e.g. when the peer left the cluster)."""
        if name not in self._local:
            segment = self._segments.pop(name, None)
            if segment is not None:
                segment.close()

    def _check(self, batch: Sequence[Descriptor]) -> None:
        for d in batch:
            for name, offset in ((d.src_segment, d.src_offset), (d.dst_segment, d.dst_offset)):
                segment = self.open(name)
                if offset < 0 or d.length < 0 or offset + d.length > segment.nbytes:
                    raise TransferError(
                        "bad_descriptor", f"[{offset}, {offset + d.length}) is outside {name} ({segment.nbytes} bytes)"
                    )

    def transfer_sync(self, batch: Sequence[Descriptor]) -> None:
        """Run a batch on the calling thread (for callers already off the event loop)."""
        self._check(batch)
        for d in batch:
            src = self._segments[d.src_segment].tensor
            dst = self._segments[d.dst_segment].tensor
            dst[d.dst_offset : d.dst_offset + d.length].copy_(src[d.src_offset : d.src_offset + d.length])
        self.bytes_moved += sum(d.length for d in batch)
        self.transfers += 1

    async def transfer(self, batch: Sequence[Descriptor], timeout: float = 30.0) -> None:
        """Run a batch off the event loop; raise TransferError if it fails or outlasts ``timeout``."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, self.transfer_sync, list(batch))
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise TransferError("timeout", f"batch of {len(batch)} descriptors took over {timeout}s") from None

    def close(self) -> None:
        for name in list(self._segments):
            self._segments.pop(name).close()
        self._local.clear()
        self._executor.shutdown(wait=False)
