"""TLS on the TCP data plane: mutual, from one cluster CA. Each side presents a
certificate the CA signed and refuses a peer whose certificate it did not sign. Peers
are reached by address, not by host name, so a peer is trusted for holding a key the CA
certified; host names are not checked. Shared memory within a host never uses it.
"""

import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class TlsFiles:
    """Where this process's certificate, its key and the cluster CA's certificate are (PEM files)."""

    cert: str
    key: str
    ca: str


class DataPlaneTls:
    """The two contexts of one engine: ``server`` wraps the listener's accepted
    connections, ``client`` the connections a sender opens. TLS 1.3 only."""

    def __init__(self, files: TlsFiles) -> None:
        self.server = _context(ssl.PROTOCOL_TLS_SERVER, files)
        self.server.num_tickets = 0  # no session resumption: connections are pooled instead
        self.client = _context(ssl.PROTOCOL_TLS_CLIENT, files)


def _context(protocol: int, files: TlsFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # peers are addresses; the CA's signature is what is checked
    context.verify_mode = ssl.CERT_REQUIRED  # both ways: the server asks for the client's certificate
    try:
        context.load_cert_chain(files.cert, files.key)
        context.load_verify_locations(cafile=files.ca)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"data-plane TLS: cannot load {files.cert}, {files.key} or {files.ca}: {e}") from e
    return context
