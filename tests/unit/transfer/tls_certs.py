"""Throwaway certificates for data-plane TLS tests: a CA (`ClusterCA`, as `kvserve up
--listen` makes one) and leaves it signs, written into a test's directory."""

from pathlib import Path

from libs.common.certificates import ClusterCA, Leaf
from libs.common.tls import TlsFiles


class TestCA:
    """A CA named ``name``; `leaf` issues a certificate it signed into ``directory``."""

    __test__ = False

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self.ca = ClusterCA.create(f"{name}-ca")

    def leaf(self, name: str, trusting: "TestCA | None" = None) -> TlsFiles:
        """A certificate for ``name`` signed by this CA, with the CA ``trusting`` (this one
        by default) as the one its holder trusts."""
        leaf = self.ca.issue(name)
        return Leaf(leaf.cert, leaf.key, (trusting or self).ca.cert).write(self.directory / f"{self.name}-{name}")
