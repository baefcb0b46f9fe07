"""A cluster's own certificate authority for TLS between its hosts (libs/common/tls.py):
`ClusterCA.create` makes one, `issue` signs a leaf any of the cluster's processes may
present, as server and as client. Keys are EC P-256. Our own peers check no host name
(tls.py), but nats-server checks a route's: a first host's leaf names its address.
"""

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from libs.common.tls import TlsFiles

VALID_DAYS = 3650  # a cluster's CA lives as long as its first host runs it; a new `kvserve up` makes a new one


@dataclass(frozen=True)
class Leaf:
    """A certificate the cluster's CA signed, with its key and the CA's certificate (PEM text)."""

    cert: str
    key: str = field(repr=False)
    ca: str

    def write(self, directory: str | Path) -> TlsFiles:
        """Write cert.pem, key.pem and ca.pem into ``directory`` (made 0700 if new; each file 0600)."""
        directory = Path(directory)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        files = TlsFiles(cert=str(directory / "cert.pem"), key=str(directory / "key.pem"), ca=str(directory / "ca.pem"))
        for path, pem in ((files.cert, self.cert), (files.key, self.key), (files.ca, self.ca)):
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(pem)
        return files


@dataclass(frozen=True)
class ClusterCA:
    cert: str  # PEM
    key: str = field(repr=False)  # PEM, unencrypted: it stays in the first host's 0700 runtime directory

    @classmethod
    def create(cls, name: str = "kvserve cluster CA") -> "ClusterCA":
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks of the hosts differ a little
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        return cls(_cert_pem(cert), _key_pem(key))

    def issue(self, name: str, addresses: Sequence[str] = ()) -> Leaf:
        """A leaf for ``name``, good for both ends of a connection, naming ``addresses`` (IP
        addresses or host names) as its subject's alternative names."""
        ca_key = serialization.load_pem_private_key(self.key.encode(), password=None)
        ca_cert = x509.load_pem_x509_certificate(self.cert.encode())
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(ca_cert.not_valid_after_utc)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
        )  # fmt: skip
        if addresses:
            cert = cert.add_extension(x509.SubjectAlternativeName([_general_name(a) for a in addresses]), critical=False)
        cert = cert.sign(ca_key, hashes.SHA256())
        return Leaf(_cert_pem(cert), _key_pem(key), self.cert)


def _general_name(address: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(address))
    except ValueError:
        return x509.DNSName(address)


def _cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()  # fmt: skip
