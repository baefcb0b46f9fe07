"""The transports an engine builds, by name, in order of preference: the first that can
reach a ticket's receiver carries the transfer. A new transport is one module with a
`Transport` and one line here, before "tcp", which reaches every host.
"""

from libs.transfer.shm import ShmTransport
from libs.transfer.tcp import TcpTransport
from libs.transfer.transport import Transport

TRANSPORTS: dict[str, type[Transport]] = {
    ShmTransport.name: ShmTransport,
    TcpTransport.name: TcpTransport,
}
