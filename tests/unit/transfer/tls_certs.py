"""Throwaway certificates for data-plane TLS tests: a CA and leaves it signs, made
with the openssl CLI into a test's directory."""

import subprocess
from pathlib import Path

from libs.transfer.tcp.tls import TlsFiles

_LEAF_EXTENSIONS = """basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth,clientAuth
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
"""


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", path)


class TestCA:
    """A CA in ``directory``; `leaf` issues a certificate it signed."""

    __test__ = False

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self.key = directory / f"{name}-ca.key"
        self.cert = directory / f"{name}-ca.pem"
        _key(self.key)
        _openssl("req", "-x509", "-new", "-key", self.key, "-out", self.cert, "-days", "1", "-subj", f"/CN={name}-ca")

    def leaf(self, name: str, trusting: "TestCA | None" = None) -> TlsFiles:
        """A certificate for ``name`` signed by this CA, with the CA ``trusting`` (this one
        by default) as the one its holder trusts."""
        key, csr, cert = (self.directory / f"{self.name}-{name}.{ext}" for ext in ("key", "csr", "pem"))
        extensions = self.directory / "leaf.ext"
        extensions.write_text(_LEAF_EXTENSIONS)
        _key(key)
        _openssl("req", "-new", "-key", key, "-out", csr, "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", self.key, "-CAcreateserial",
                 "-out", cert, "-days", "1", "-extfile", extensions)  # fmt: skip
        return TlsFiles(cert=str(cert), key=str(key), ca=str((trusting or self).cert))
