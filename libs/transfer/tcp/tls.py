"""TLS on the TCP data plane: mutual, from one cluster CA (libs/common/tls.py). Each
connection's TLS session authenticates both ends and agrees the keys of its sealed
records (`sealed.py`). Shared memory within a host never uses it."""

from libs.common.tls import TlsFiles, mutual_context

__all__ = ["DataPlaneTls", "TlsFiles"]


class DataPlaneTls:
    """The two contexts of one engine: ``server`` wraps the listener's accepted
    connections, ``client`` the connections a sender opens. TLS 1.3 only."""

    def __init__(self, files: TlsFiles) -> None:
        self.server = mutual_context(files, server=True)
        self.server.num_tickets = 0  # no session resumption: connections are pooled instead
        self.client = mutual_context(files, server=False)
