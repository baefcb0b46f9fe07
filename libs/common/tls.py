"""Mutual TLS between a cluster's processes, from one cluster CA (libs/common/certificates.py):
on the TCP data plane (libs/transfer/tcp/tls.py) and on NATS between hosts. Each side
presents a certificate the CA signed and refuses a peer whose certificate it did not sign.
Peers are reached by address, so a peer is trusted for holding a key the CA certified; a
client checks no host name. TLS 1.3 only.
"""

import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class TlsFiles:
    """Where this process's certificate, its key and the cluster CA's certificate are (PEM files)."""

    cert: str
    key: str
    ca: str


def mutual_context(files: TlsFiles, server: bool) -> ssl.SSLContext:
    """A context that presents ``files``' certificate and requires the peer's, signed by its CA;
    ValueError naming the files when they cannot be loaded."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # peers are addresses; the CA's signature is what is checked
    context.verify_mode = ssl.CERT_REQUIRED  # both ways: the server asks for the client's certificate
    try:
        context.load_cert_chain(files.cert, files.key)
        context.load_verify_locations(cafile=files.ca)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"TLS: cannot load {files.cert}, {files.key} or {files.ca}: {e}") from e
    return context
