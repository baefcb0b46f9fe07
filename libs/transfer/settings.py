"""How a process moves KV bytes: which transport, where it listens, how long it waits.
Beside the registry, so a transport's name is valid exactly when one is registered."""

from dataclasses import dataclass
from typing import Self

from libs.common.settings import env_float, env_int, env_str
from libs.common.tls import TlsFiles
from libs.transfer.registry import TRANSPORTS


@dataclass(frozen=True)
class TransferSettings:
    """How a process moves KV bytes: which transport, where it listens, how long it waits."""

    listen_host: str = "127.0.0.1"  # the TCP listener's address (port chosen by the OS)
    transport: str = "auto"  # auto: shared memory with peers on this host, TCP otherwise
    timeout: float = 30.0
    connections: int = 4
    max_connections: int = 64  # the listener's cap on open connections; more are closed at once
    idle_timeout: float = 60.0  # the listener closes a connection silent this long
    # mutual TLS on the TCP data plane: PEM files of this process's certificate, its key and
    # the cluster CA; all three, or none for plain TCP (a trusted network)
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    def __post_init__(self) -> None:
        if self.transport != "auto" and self.transport not in TRANSPORTS:
            names = ", ".join(["auto", *TRANSPORTS])
            raise ValueError(f"KVSERVE_TRANSPORT must be one of {names}, got {self.transport!r}")
        if self.timeout <= 0 or self.connections < 1:
            raise ValueError("KVSERVE_TRANSFER_TIMEOUT and KVSERVE_TRANSFER_CONNECTIONS must be positive")
        if self.max_connections < 1 or self.idle_timeout <= 0:
            raise ValueError("KVSERVE_TRANSFER_MAX_CONNECTIONS and KVSERVE_TRANSFER_IDLE_TIMEOUT must be positive")
        if len({bool(self.tls_cert), bool(self.tls_key), bool(self.tls_ca)}) > 1:
            raise ValueError("KVSERVE_TRANSFER_TLS_CERT, _KEY and _CA go together: all three for TLS, none for plain TCP")

    @property
    def tls(self) -> TlsFiles | None:
        """The data plane's TLS files; None: plain TCP."""
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca) if self.tls_cert else None

    @classmethod
    def from_env(cls) -> Self:
        return cls(
            listen_host=env_str("TRANSFER_HOST", "127.0.0.1"),
            transport=env_str("TRANSPORT", "auto"),
            timeout=env_float("TRANSFER_TIMEOUT", 30.0),
            connections=env_int("TRANSFER_CONNECTIONS", 4),
            max_connections=env_int("TRANSFER_MAX_CONNECTIONS", 64),
            idle_timeout=env_float("TRANSFER_IDLE_TIMEOUT", 60.0),
            tls_cert=env_str("TRANSFER_TLS_CERT", ""),
            tls_key=env_str("TRANSFER_TLS_KEY", ""),
            tls_ca=env_str("TRANSFER_TLS_CA", ""),
        )
