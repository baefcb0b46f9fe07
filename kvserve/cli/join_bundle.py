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

A control-plane bundle (``kvserve up --write-control-bundle PATH``) is a join bundle with
a ``control`` part: what a host needs to run a control plane of its own beside the first
host's (``kvserve join --control-plane``) — a nats-server routed into the first host's
NATS cluster (every NATS user with its password, the route password, the CA's key to
certify that server's address), a conductor replica and a gateway (the conductor's and
gateway's NATS users, the API key or the tenants file). It is the cluster's whole set
of keys: give it only to hosts you would run the first host's services on.
"""

import json
import logging
import os
import stat
from pathlib import Path

import msgspec

from libs.common.nats_auth import CREDENTIALS, OBSERVER, Identity, write_private
from libs.common.nats_server import NatsServer, Routes
from libs.common.tls import TlsFiles
from libs.protocol.errors import KVServeError
from libs.protocol.vocabulary import Role

log = logging.getLogger("kvserve.join")

VERSION = 1
JOINABLE_ROLES = (Role.PREFILL, Role.DECODE, Role.STORE)  # a joining host runs workers and stores
CONTROL_ROLES = (Role.CONDUCTOR, Role.GATEWAY)  # and with a control-plane bundle, these too


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


class BundleUser(msgspec.Struct, forbid_unknown_fields=True):
    """One of the cluster's NATS users (libs/common/nats_auth.py `Identity`) and its password."""

    role: str
    instance_id: str | None
    password: str

    @property
    def identity(self) -> Identity:
        return Identity(self.role, self.instance_id)


class BundleControl(msgspec.Struct, forbid_unknown_fields=True):
    """What a control-plane host needs beyond a joining host's (a control-plane bundle only)."""

    route_ports: list[int]  # every nats-server's route port on the first host
    route_password: str
    users: list[BundleUser]  # every NATS user of the cluster: a routed server must have them all
    ca_key: str | None  # PEM, the cluster CA's key: certifies the control-plane host's nats-server; None: no TLS
    api_key: str | None  # the gateway's, if the first host's has one
    tenants: str | None  # the first host's tenants file, its text, if it has one


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
    control: BundleControl | None = None  # a control-plane bundle's secrets; None in a join bundle

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
    if bundle.control is not None and (missing := [u for u in CONTROL_ROLES if u not in bundle.nats.passwords]):
        raise JoinBundleError(f"{path} has no NATS user for {', '.join(missing)}")
    if bundle.control is not None and bundle.tls is not None and bundle.control.ca_key is None:
        raise JoinBundleError(f"{path} has no CA key to certify a control-plane host's nats-server")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the join bundle %s is open to other users (mode %o): chmod 600 it", path, mode & 0o777)
    return bundle


class JoinedNats:
    """The first host's NATS, seen from a joining host: what LocalCluster needs of a
    `NatsCluster` (URLs, each instance's credentials file). ``host``: the first host's
    address as this host reaches it. A control-plane host also runs a nats-server of its
    own (``local``) routed into the first host's cluster; its URL comes first, and it is
    started, stopped and watched like the first host's (``servers``)."""

    def __init__(self, bundle: JoinBundle, host: str, directory: Path, instances: dict[str, str],
                 local: NatsServer | None = None) -> None:  # fmt: skip
        self.servers: list[NatsServer] = [] if local is None else [local]
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
        ours = [server.url_for(user) for server in self.servers]
        return ",".join(ours + [f"nats://{user}:{password}@{self.host}:{port}" for port in self.bundle.nats.ports])

    @property
    def url(self) -> str:
        return self.url_for(OBSERVER)  # a joining host gets no admin user

    @property
    def public_url(self) -> str:
        return ",".join([server.public_url for server in self.servers] + [self.bundle.nats_urls(self.host)])

    @property
    def pids(self) -> list[int | None]:
        return [server.pid for server in self.servers]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()  # the credentials go with the cluster's runtime directory


def control_plane_server(control: BundleControl, host: str, listen: str, name: str, directory: Path,
                         tls: TlsFiles | None) -> NatsServer:  # fmt: skip
    """A control-plane host's nats-server: on ``listen``, with the first host's users (from a
    control-plane bundle's ``control``), routed to its servers (at ``host``, as this host
    reaches it), mutual TLS with ``tls`` (a leaf naming ``listen``); no JetStream of its own,
    so the first host's JetStream quorum is its alone."""
    peers = [f"{host}:{port}" for port in control.route_ports]
    return NatsServer(listen, directory=directory, routes=Routes(control.route_password, lambda: peers), name=name,
                      users={user.identity: user.password for user in control.users}, tls=tls, jetstream=False)  # fmt: skip
