"""The TCP transport's writer: it slices spans and sends them over a few parallel
connections (one per lane), opened or taken from the engine's idle ones only as the
slices need them.
"""

import ssl
from concurrent.futures import Executor

from libs.protocol.schema import WriteTicket
from libs.protocol.vocabulary import ErrorCode
from libs.transfer.descriptors import Span, TransferError, split_spans
from libs.transfer.segment import SharedSegment
from libs.transfer.tcp.connection import IdleConnections, TcpConnection
from libs.transfer.tcp.wire import new_nonces
from libs.transfer.writers import Lane, Writer

_DONE = object()  # a lane's last item: it sends its end frame and waits for the receiver's status


class TcpWriter(Writer):
    transport = "tcp"

    def __init__(
        self, source: SharedSegment, ticket: WriteTicket, timeout: float, pool: Executor, idle: IdleConnections,
        connections: int, slice_bytes: int, tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        super().__init__(source, timeout, pool)
        if not ticket.address:
            raise TransferError(ErrorCode.PEER_GONE, (
                f"the receiver on host {ticket.host_id!r} gave no TCP address: it has no listener, or issued the "
                f"ticket for a shared-memory writer on its host (processes that share a KVSERVE_HOST_ID must share "
                f"/dev/shm)"))  # fmt: skip
        self.ticket = ticket
        self.idle = idle  # the engine's idle connections, by receiver address
        self.tls = tls  # the client context of the data plane's TLS; None: plain TCP
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
                self._lanes.append(Lane(self))
            self._lanes[self._next].put([span])
            self._next = (self._next + 1) % self.max_lanes

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            for lane in self._lanes:
                lane.put(_DONE)

    def _process(self, lane: Lane, item) -> None:
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
                lane.connection = TcpConnection(self.ticket.address, self.ticket.token, self.deadline, self.idle,
                                                nonces=self.nonces, tls=self.tls)  # fmt: skip
            lane.connection.send(self.source.view, item)
        except TransferError:
            if lane.connection is not None:
                lane.connection.close()
                lane.connection = None
            raise
        self._count(sum(s.length for s in item))
