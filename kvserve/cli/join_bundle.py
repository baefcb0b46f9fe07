"""The join bundle: what another host needs to join a cluster this host runs.

``kvserve up --listen ADDR --write-join-bundle PATH`` writes it once: the NATS servers'
ports, a NATS user per joinable role (prefill, decode, store) and the observer's, the
data plane's TLS leaf with the cluster CA's certificate, the first host's id and the
KV contract every worker must share (the model's dtype and weight precision).
``kvserve join ADDR --bundle PATH`` reads it (`JoinedNats` gives its workers their
credentials). The file is JSON, 0600; it holds secrets, so it is copied like a key
(scp), never passed on a command line, and never logged.

The joined workers' NATS users are per role, not per instance (their ids are made on
the joining host): one joined decode worker may read another decode worker's requests,
as with docker compose's role users (libs/common/nats_auth.py).
"""

import json
import logging
import os
import stat
from pathlib import Path

import msgspec

from libs.common.nats_auth import CREDENTIALS, OBSERVER, write_private
from libs.protocol.errors import KVServeError
from libs.protocol.vocabulary import Role

log = logging.getLogger("kvserve.join")

VERSION = 1
JOINABLE_ROLES = (Role.PREFILL, Role.DECODE, Role.STORE)  # a joining host runs workers and stores only


class JoinBundleError(KVServeError):
    """A join bundle that cannot be read or used."""


class BundleNats(msgspec.Struct, forbid_unknown_fields=True):
    ports: list[int]  # every nats-server's client port on the first host
    passwords: dict[str, str]  # by user: the joinable roles' and the observer's


class BundleTls(msgspec.Struct, forbid_unknown_fields=True):
    """PEM text: a leaf the cluster CA signed, its key, the CA's certificate."""

    cert: str
    key: str
    ca: str


class BundleModel(msgspec.Struct, forbid_unknown_fields=True):
    spec: str | None  # what the first host was given (a path, a file); None: the default model
    dtype: str  # resolved, never "auto": the KV every worker shares is in it
    quantization: str


class JoinBundle(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    host: str  # the first host's address, as it listens (--listen)
    host_id: str  # the first host's id: a joining host must have another
    nats: BundleNats
    model: BundleModel
    tls: BundleTls | None  # None: the data plane between hosts is plain TCP (--no-tls)

    def nats_urls(self, host: str | None = None) -> str:
        """Every nats-server's URL on ``host`` (default: the address in the bundle), comma-separated, no secret."""
        return ",".join(f"nats://{host or self.host}:{port}" for port in self.nats.ports)


def write_bundle(path: str | Path, bundle: JoinBundle) -> None:
    """Write ``bundle`` to ``path``, 0600, whole or not at all (the folder is left as it is)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(msgspec.json.format(msgspec.json.encode(bundle)) + b"\n")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


def read_bundle(path: str | Path) -> JoinBundle:
    """The bundle at ``path``; JoinBundleError saying what is wrong with it otherwise."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        raw = path.read_bytes()
    except OSError as e:
        raise JoinBundleError(f"cannot read the join bundle {path}: {e.strerror}") from None
    try:
        bundle = msgspec.json.decode(raw, type=JoinBundle)
    except msgspec.ValidationError as e:
        raise JoinBundleError(f"{path} is not a kvserve join bundle: {e}") from None
    except msgspec.DecodeError:
        raise JoinBundleError(f"{path} is not a kvserve join bundle: not JSON") from None
    if bundle.version != VERSION:
        raise JoinBundleError(f"{path} is a version {bundle.version} join bundle; this kvserve reads version {VERSION}")
    if missing := [user for user in (*JOINABLE_ROLES, OBSERVER) if user not in bundle.nats.passwords]:
        raise JoinBundleError(f"{path} has no NATS user for {', '.join(missing)}")
    if not bundle.nats.ports:
        raise JoinBundleError(f"{path} names no nats-server")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the join bundle %s is open to other users (mode %o): chmod 600 it", path, mode & 0o777)
    return bundle


class JoinedNats:
    """The first host's NATS, seen from a joining host: what LocalCluster needs of a
    `NatsCluster` (URLs, each instance's credentials file) with no server of its own to
    start, stop or watch. ``host``: the first host's address as this host reaches it."""

    def __init__(self, bundle: JoinBundle, host: str, directory: Path, instances: dict[str, str]) -> None:
        self.servers: list = []  # none runs here
        self.bundle = bundle
        self.host = host
        self.instances = instances  # {instance id: role}: each uses its role's user
        self.directory = directory
        for user in (*{instances[i] for i in instances}, OBSERVER):
            password = bundle.nats.passwords[user]
            write_private(self._credentials(user), json.dumps({"user": user, "password": password}) + "\n")

    def _credentials(self, user: str) -> Path:
        return self.directory / "nats-auth" / user / CREDENTIALS

    def credentials_file(self, instance_id: str) -> Path:
        return self._credentials(self.instances.get(instance_id, instance_id))

    def url_for(self, user: str) -> str:
        """``user``'s URLs, credentials included (in this process only, never logged)."""
        password = self.bundle.nats.passwords[user]
        return ",".join(f"nats://{user}:{password}@{self.host}:{port}" for port in self.bundle.nats.ports)

    @property
    def url(self) -> str:
        return self.url_for(OBSERVER)  # a joining host gets no admin user

    @property
    def public_url(self) -> str:
        return self.bundle.nats_urls(self.host)

    @property
    def pids(self) -> list[int | None]:
        return []

    def stop(self) -> None:
        pass  # the credentials go with the cluster's runtime directory
