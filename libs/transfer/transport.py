"""What a transport is: how a sender's writer reaches a ticket's destination, and what a
receiver opens so that it can be reached. The engine knows transports only through this
interface; `registry.py` names the ones it builds.
"""

from abc import ABC, abstractmethod
from concurrent.futures import Executor
from typing import TYPE_CHECKING, ClassVar, Protocol

from libs.protocol.schema import WriteTicket
from libs.transfer.segment import SharedSegment
from libs.transfer.tickets import TicketBook
from libs.transfer.transfer_metrics import TransferMetrics
from libs.transfer.writers import Writer

if TYPE_CHECKING:  # the tcp package imports this module
    from libs.common.tls import TlsFiles


class Host(Protocol):
    """What a transport may use of the engine that owns it."""

    host_id: str
    listen: str | None  # "host:port" where a receiver may listen; None: nowhere
    connections: int  # at most this many parallel connections per transfer
    slice_bytes: int  # spans are cut into slices of at most this many bytes
    max_connections: int  # a listener serves at most this many connections
    idle_timeout: float  # ... and closes those idle this long
    tls: "TlsFiles | None"  # mutual TLS between hosts; None: plain TCP
    tickets: TicketBook  # the tickets this engine has issued
    pool: Executor  # the threads that run writers' lanes
    metrics: TransferMetrics  # where transfers and the listener's refusals are counted

    def segment(self, name: str) -> SharedSegment: ...

    def claim(self, ticket: WriteTicket) -> None: ...


class Transport(ABC):
    """One way of moving bytes, built once per engine and closed with it. A sender asks
    it for a writer on a ticket; a receiver asks it to be reachable from another host."""

    name: ClassVar[str]  # in KVSERVE_TRANSPORT and the metrics' `transport` label
    same_host_only: ClassVar[bool] = False  # reaches only receivers on this host, through no address

    def __init__(self, host: Host) -> None:
        self.host = host

    @abstractmethod
    def can_reach(self, ticket: WriteTicket) -> bool:
        """Whether a writer of this transport can fill ``ticket`` from here."""

    @abstractmethod
    def make_writer(self, ticket: WriteTicket, source: SharedSegment, timeout: float) -> Writer:
        """A writer from ``source`` to the ticket's destination; raises TransferError when
        the destination cannot be reached or the ticket is already taken."""

    def open_receiver(self) -> str | None:
        """Be reachable from senders on other hosts; return the address a ticket gives them,
        or None where this transport needs none (or may not listen)."""
        return None

    def close(self) -> None:
        """Release what this transport holds (listeners, idle connections). Idempotent."""
