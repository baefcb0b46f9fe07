"""The TCP transport: a sender anywhere writes through a connection to the receiver's
listener, whose address the ticket carries. The listener opens only when a ticket is
issued for a sender that may be on another host (or when the engine sends over TCP
only): a process whose peers are all on its host listens on no port.
"""

import logging
import threading

from libs.protocol.schema import WriteTicket
from libs.transfer.segment import SharedSegment
from libs.transfer.tcp.connection import IdleConnections
from libs.transfer.tcp.listener import TcpListener
from libs.transfer.tcp.tls import DataPlaneTls
from libs.transfer.tcp.writer import TcpWriter
from libs.transfer.transport import Host, Transport
from libs.transfer.writers import Writer

log = logging.getLogger(__name__)


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self.idle = IdleConnections()  # connections to receivers, kept for the next transfer
        self.tls = None if host.tls is None else DataPlaneTls(host.tls)
        self.listener: TcpListener | None = None
        self._lock = threading.Lock()

    def can_reach(self, ticket: WriteTicket) -> bool:
        return True  # any host; a receiver that gave no address refuses at `make_writer`

    def make_writer(self, ticket: WriteTicket, source: SharedSegment, timeout: float) -> Writer:
        host = self.host
        return TcpWriter(source, ticket, timeout, host.pool, self.idle, host.connections, host.slice_bytes,
                         tls=None if self.tls is None else self.tls.client)  # fmt: skip

    def open_receiver(self) -> str | None:
        with self._lock:
            if self.listener is None and self.host.listen is not None:
                address, port = self.host.listen.rsplit(":", 1)
                self.listener = TcpListener(address, int(port), self.host.tickets, self.host.metrics,
                                            max_connections=self.host.max_connections,
                                            idle_timeout=self.host.idle_timeout,
                                            tls=None if self.tls is None else self.tls.server)  # fmt: skip
                log.info("transfer listener on %s (%s)", self.listener.address, "TLS" if self.tls else "plain TCP")
            return None if self.listener is None else self.listener.address

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        self.idle.clear()
