"""Who may say what on NATS: the users, the subjects each may publish and subscribe
to, and the files that carry the secrets.

A user is an identity (`Identity`): one service instance's own, or one role's.

- **An instance's own user** (``decode-0``) may use only the subjects that name that
  instance: a decode worker subscribes to its own reserve, admit, release and prefill
  subjects and publishes tokens only under its own name (``subjects.tokens(request,
  itself)``); a prefill worker reads its own submissions and publishes its own tokens and
  KV events; a store reads its own operations and publishes its own KV events; each reads
  only its own metrics, snapshot and conductor-view requests and its own inbox
  (``_INBOX.<role>.<instance>``). The gateway takes a request's tokens only from the
  instances it is placed on (services/gateway/dispatch.py), so no instance can write into
  a stream not its own. `kvserve up` starts every instance itself and gives each its own
  user (a restarted instance keeps its id and its credentials).
- **A role's user** (``decode``) may do what any instance of the role may: the same
  subjects with ``*`` for the instance. It exists for deployments that cannot know their
  instance ids before they start (docker compose ``--scale`` and Kubernetes Deployments
  give each process a random id): there an instance of a role can read the other
  instances' requests of that role and publish tokens, KV events and heartbeats under
  their names.
  Give every instance whose id is fixed its own user instead (``kvserve nats-config
  --instance``).

Heartbeats name their sender too (an instance's user speaks only for itself, and a
receiver believes a heartbeat only from the subject of the instance it names);
cancellations and roll calls are broadcasts every service shares.

nats-server reads its users from a configuration file and each service its own user
from a credentials file; both are 0600 in 0700 directories. A secret is never on a
command line or in a log line: URLs are logged through `redact_url`.
"""

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from base64 import urlsafe_b64encode
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from libs.common.tls import TlsFiles
from libs.protocol import subjects as s
from libs.protocol.ids import InstanceId
from libs.protocol.vocabulary import Role

log = logging.getLogger("kvserve.nats")

SERVICE_ROLES = tuple(Role)
# observer: watches heartbeats and reads metrics (`kvserve up`'s own watcher);
# admin: every subject, for an operator's tools and tests, never given to a service.
OBSERVER, ADMIN = "observer", "admin"
TOOLS = (OBSERVER, ADMIN)
SERVER_CONFIG = Path("nats-server") / "nats.conf"  # under the auth directory
CLUSTER_CONFIG = Path("nats-server") / "cluster.conf"  # beside it: the users and the routes of a cluster
CLUSTER_NAME = "kvserve"
ROUTE_USER = "route"  # the user the servers of one cluster connect their routes as
CLUSTER_PORT = 6222  # nats-server's usual route port
CREDENTIALS = "credentials.json"  # under the auth directory, in a folder per user
MIN_SECRET_LENGTH = 16
# A connection (client's or route's) whose peer stopped answering is dropped after at most
# PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1) seconds, not NATS's default ~6 minutes: a
# host whose link goes down leaves no FIN or RST, and until then its clients would not move
# to another server (a control-plane host's, kvserve join --control-plane).
PING_INTERVAL_S = 3
MAX_OUTSTANDING_PINGS = 2
KEEPALIVE = {"ping_interval": PING_INTERVAL_S, "max_outstanding_pings": MAX_OUTSTANDING_PINGS}  # nats.connect's
JETSTREAM_MEMORY_BYTES = 512 << 20  # the KV history's streams, in memory (libs/common/kv_history.py bounds each)
JETSTREAM_FILE_BYTES = 64 << 20  # none of kvserve's streams is on disk


class NatsAuthError(ValueError):
    """A credentials file or secret that cannot be used."""


@dataclass(frozen=True)
class Identity:
    """A NATS user: one instance of a role (``instance_id``), or any instance of it (None)."""

    role: str
    instance_id: InstanceId | None = None

    @property
    def user(self) -> str:
        return self.instance_id or self.role


def role_identities() -> list[Identity]:
    """A user per service role, then the tools' (observer, admin)."""
    return [Identity(role) for role in SERVICE_ROLES + TOOLS]


def instance_identities(instances: dict[str, str]) -> list[Identity]:
    """A user per instance (``{instance id: role}``), then the tools'."""
    for instance_id, role in instances.items():
        if role not in SERVICE_ROLES:
            raise NatsAuthError(f"{instance_id}: no such role {role!r}")
        if instance_id in SERVICE_ROLES + TOOLS:
            raise NatsAuthError(f"an instance cannot be called {instance_id!r}: that is a role's user")
        try:
            s.metrics(instance_id)  # one subject token
        except ValueError as e:
            raise NatsAuthError(f"instance id {e}") from None
    return [Identity(role, instance_id) for instance_id, role in instances.items()] + [Identity(t) for t in TOOLS]


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool = True  # may answer the requests it receives (on their reply subjects only)


def inbox_prefix(role: str, instance_id: InstanceId | None = None) -> str:
    """Where request replies arrive: one prefix per role and instance, so no role reads
    another's replies, and no instance with a user of its own another instance's."""
    return f"_INBOX.{role}" if instance_id is None else f"_INBOX.{role}.{instance_id}"


# The roles that send requests a service answers. A service may publish to their inboxes
# outright, not only through allow_responses: nats-server forgets which replies a client
# owes when it reconnects, so without this an answer computed across a NATS restart is
# refused and its requester waits out its timeout. Reading an inbox stays its owner's alone.
REQUESTERS = (Role.GATEWAY, Role.CONDUCTOR, Role.PREFILL, OBSERVER)


def permissions(identity: Identity) -> Permissions:
    """What ``identity`` may publish and subscribe to."""
    role, instance_id = identity.role, identity.instance_id
    if role == ADMIN:
        return Permissions(publish=(">",), subscribe=(">",), responds=False)
    if role == OBSERVER:
        return Permissions(publish=(s.METRICS_ALL,), subscribe=(s.HEARTBEAT_ALL, inbox_prefix(OBSERVER) + ".>"),
                           responds=False)  # fmt: skip

    def own(subject: Callable[[str], str], of_any: str) -> str:
        """The subject of this instance, or (a role's user) of any instance of the role."""
        return subject(instance_id) if instance_id is not None else of_any

    if role == Role.GATEWAY:  # the gateway alone admits and submits requests, cancels them and reads their tokens
        grants = dict(
            publish=(s.CONDUCTOR_ADMIT, s.CONDUCTOR_PROGRESS, s.PREFILL_SUBMIT_ALL, s.DECODE_PREFILL_ALL,
                     s.DECODE_RESEND_ALL, s.CANCEL, s.METRICS_ALL, s.CONDUCTOR_VIEW_ALL),
            subscribe=(s.HEARTBEAT_ALL, s.TOKENS_ALL),
        )  # fmt: skip
    elif role == Role.CONDUCTOR:
        grants = dict(
            publish=(s.KV_SNAPSHOT_ALL, s.CONDUCTOR_ADMITTED, *s.kv_history_api()),
            subscribe=(s.HEARTBEAT_ALL, s.KV_EVENTS_ALL, s.CONDUCTOR_PROGRESS, s.CONDUCTOR_ADMIT,
                       own(s.conductor_view, s.CONDUCTOR_VIEW_ALL), s.CONDUCTOR_ADMITTED),
        )  # fmt: skip
    elif role == Role.PREFILL:  # prefill and decode workers alone publish tokens, each under its own name
        grants = dict(
            publish=(own(s.tokens_from, s.TOKENS_ALL), s.DECODE_RESERVE_ALL, s.DECODE_ADMIT_ALL, s.DECODE_RELEASE_ALL,
                     s.STORE_OPS_ALL, own(s.kv_events, s.KV_EVENTS_ALL), own(s.kv_checkpoint, s.KV_CHECKPOINT_ALL)),
            subscribe=(own(s.prefill_submit, s.PREFILL_SUBMIT_ALL), s.CANCEL, s.heartbeats(Role.DECODE),
                       s.heartbeats(Role.STORE), own(s.kv_snapshot, s.KV_SNAPSHOT_ALL)),
        )  # fmt: skip
    elif role == Role.DECODE:
        grants = dict(
            publish=(own(s.tokens_from, s.TOKENS_ALL),),
            subscribe=(own(s.decode_reserve, s.DECODE_RESERVE_ALL), own(s.decode_admit, s.DECODE_ADMIT_ALL),
                       own(s.decode_release, s.DECODE_RELEASE_ALL), own(s.decode_prefill, s.DECODE_PREFILL_ALL),
                       own(s.decode_resend, s.DECODE_RESEND_ALL), s.CANCEL),
        )  # fmt: skip
    elif role == Role.STORE:
        grants = dict(
            publish=(own(s.kv_events, s.KV_EVENTS_ALL), own(s.kv_checkpoint, s.KV_CHECKPOINT_ALL)),
            subscribe=(own(s.store_ops, s.STORE_OPS_ALL), own(s.kv_snapshot, s.KV_SNAPSHOT_ALL)),
        )
    else:
        raise NatsAuthError(f"no such role {role!r}")
    # what every service does: heartbeats, roll calls, its metrics, replies to requesters,
    # and (those that send requests) reading its own inbox
    inbox = (inbox_prefix(role, instance_id) + ".>",) if role in REQUESTERS else ()
    replies = tuple(inbox_prefix(requester) + ".>" for requester in REQUESTERS)
    return Permissions(
        publish=(own(partial(s.heartbeat, role), s.heartbeats(role)), s.ROLL_CALL) + grants["publish"] + replies,
        subscribe=(s.ROLL_CALL, own(s.metrics, s.METRICS_ALL)) + grants["subscribe"] + inbox,
    )


# --- credentials ------------------------------------------------------------------
@dataclass(frozen=True)
class NatsCredentials:
    """A user and password, or a token: what a client presents to nats-server."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    def connect_options(self) -> dict[str, str]:
        """Keyword arguments for ``nats.connect`` (they take precedence over a URL's own)."""
        if self.token is not None:
            return {"token": self.token}
        return {"user": self.user, "password": self.password}


def load_credentials(path: str | Path) -> NatsCredentials:
    """Read a credentials file: ``{"user": ..., "password": ...}`` or ``{"token": ...}``."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        raw = json.loads(path.read_text())
    except OSError as e:
        raise NatsAuthError(f"cannot read the NATS credentials file {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise NatsAuthError(f"the NATS credentials file {path} is not JSON") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the NATS credentials file %s is open to other users (mode %o): chmod 600 it", path, mode & 0o777)
    fields = raw if isinstance(raw, dict) else {}
    if not all(isinstance(value, str) and value for value in fields.values()):
        fields = {}
    if set(fields) == {"user", "password"}:
        return NatsCredentials(user=fields["user"], password=fields["password"])
    if set(fields) == {"token"}:
        return NatsCredentials(token=fields["token"])
    raise NatsAuthError(f'the NATS credentials file {path} must hold {{"user": ..., "password": ...}} or {{"token": ...}}')

def server_urls(url: str) -> list[str]:
    """The servers of a NATS URL setting: one URL, or a cluster's, comma-separated."""
    return [one.strip() for one in url.split(",") if one.strip()]


def redact_url(url: str) -> str:
    """A NATS URL (or comma-separated URLs) without credentials, for logs."""
    redacted = []
    for one in url.split(","):
        head, at, host = one.rpartition("@")
        scheme = head.split("://", 1)[0] + "://" if "://" in head else ""
        redacted.append(f"{scheme}***@{host}" if at else one)
    return ",".join(redacted)


# --- the files ----------------------------------------------------------------------
def random_passwords(identities: Iterable[Identity]) -> dict[str, str]:
    return {identity.user: secrets.token_urlsafe(24) for identity in identities}


def derived_passwords(secret: str, identities: Iterable[Identity]) -> dict[str, str]:
    """Every user's password from one secret (HMAC-SHA256), so a deployment keeps one secret
    and gets the same files each time it writes them."""
    if len(secret) < MIN_SECRET_LENGTH:
        raise NatsAuthError(f"the NATS secret must be at least {MIN_SECRET_LENGTH} characters")
    key = secret.encode()
    return {
        identity.user: urlsafe_b64encode(hmac.new(key, f"kvserve-nats/{identity.user}".encode(), hashlib.sha256)
                                         .digest()).decode().rstrip("=")
        for identity in identities
    }  # fmt: skip


def derived_route_password(secret: str) -> str:
    """The route user's password from the deployment's one secret (see `derived_passwords`)."""
    return derived_passwords(secret, [Identity(ROUTE_USER)])[ROUTE_USER]


def cluster_config(users_file: str, listen: str, password: str, routes: Iterable[str], tls: TlsFiles | None = None,
                   jetstream_dir: str | None = None) -> str:  # fmt: skip
    """A cluster member's configuration: the users' file (``users_file``, beside it),
    included, and the cluster block (`cluster_block`); with ``tls``, mutual TLS on its
    clients' connections and its routes (`tls_config`); with ``jetstream_dir``, JetStream
    (`jetstream_block`; each server is then given its name with ``--server_name``)."""
    return (tls_config(users_file, tls) + cluster_block(listen, password, routes, tls)
            + (jetstream_block(jetstream_dir) if jetstream_dir else ""))  # fmt: skip


def cluster_block(listen: str, password: str, routes: Iterable[str], tls: TlsFiles | None = None) -> str:
    """Where a cluster member takes routes (``listen``, host:port) and the route URLs of the
    members (``routes``, host:port; its own is ignored by nats-server), each authenticating
    as the route user; with ``tls``, the routes speak mutual TLS."""
    urls = [json.dumps(f"nats://{ROUTE_USER}:{password}@{route}") for route in routes]
    return (
        "cluster {\n"
        f'  name: "{CLUSTER_NAME}"\n'
        f'  listen: "{listen}"\n'
        f'  authorization {{ user: "{ROUTE_USER}", password: {json.dumps(password)} }}\n'
        f"  routes: [{', '.join(urls)}]\n"
        + (_tls_block(tls, "  ") if tls is not None else "")
        + "}\n"
    )


def jetstream_config(name: str, store_dir: str) -> str:
    """JetStream on, for the KV history a starting conductor catches up from
    (libs/common/kv_history.py): in memory, bounded; ``store_dir`` keeps only its
    bookkeeping. ``name``, the server's, must differ between the servers of a cluster."""
    return server_name(name) + jetstream_block(store_dir)


def server_name(name: str) -> str:
    """A server's name in its cluster (its routes and JetStream tell servers apart by it)."""
    return f"server_name: {json.dumps(name)}\n"


def jetstream_block(store_dir: str) -> str:
    """`jetstream_config` without the server's name (given on nats-server's command line)."""
    return (
        "jetstream {\n"
        f"  store_dir: {json.dumps(store_dir)}\n"
        f"  max_memory_store: {JETSTREAM_MEMORY_BYTES}\n"
        f"  max_file_store: {JETSTREAM_FILE_BYTES}\n"
        "}\n"
    )


def tls_config(users_file: str, tls: TlsFiles | None) -> str:
    """A server's configuration: the users' file (``users_file``, beside it), included, the
    keepalive (`PING_INTERVAL_S`, on clients and routes), and with ``tls`` mutual TLS on
    every client connection: a client must present a certificate the CA signed (services do,
    `tls_context`), or nats-server refuses it before it can log in."""
    keepalive = f'ping_interval: "{PING_INTERVAL_S}s"\nping_max: {MAX_OUTSTANDING_PINGS}\n'
    return f'include "{users_file}"\n' + keepalive + (_tls_block(tls, "") if tls is not None else "")


def _tls_block(tls: TlsFiles, indent: str) -> str:
    return (
        f"{indent}tls {{\n"
        f"{indent}  cert_file: {json.dumps(tls.cert)}\n"
        f"{indent}  key_file: {json.dumps(tls.key)}\n"
        f"{indent}  ca_file: {json.dumps(tls.ca)}\n"
        f"{indent}  verify: true\n"
        f"{indent}  min_version: \"1.3\"\n"
        f"{indent}  timeout: 5\n"
        f"{indent}}}\n"
    )


def server_config(identities: Iterable[Identity], passwords: dict[str, str]) -> str:
    """nats-server's authorization block: every user with its password and permissions."""
    users = []
    for identity in identities:
        grants = permissions(identity)
        allowed: dict = {"publish": {"allow": list(grants.publish)}, "subscribe": {"allow": list(grants.subscribe)}}
        if grants.responds:
            allowed["allow_responses"] = True
        users.append({"user": identity.user, "password": passwords[identity.user], "permissions": allowed})
    body = json.dumps({"authorization": {"users": users}}, indent=2)
    return f"# kvserve's NATS users (see libs/common/nats_auth.py). Keep this file 0600.\n{body}\n"


@dataclass(frozen=True)
class AuthFiles:
    """Where `write_auth_files` put nats-server's configuration and each user's credentials."""

    directory: Path
    users: tuple[str, ...]

    @property
    def server_config(self) -> Path:
        return self.directory / SERVER_CONFIG

    def credentials(self, user: str) -> Path:
        if user not in self.users:
            raise KeyError(f"no NATS user {user!r}; there are {', '.join(self.users)}")
        return self.directory / user / CREDENTIALS


def write_auth_files(directory: str | Path, identities: Iterable[Identity], passwords: dict[str, str]) -> AuthFiles:
    """Write ``directory/nats-server/nats.conf`` and ``directory/<user>/credentials.json``
    for every identity: each folder 0700, each file 0600, whole or not at all."""
    identities = list(identities)
    files = AuthFiles(Path(directory), tuple(identity.user for identity in identities))
    files.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new one private too
    write_private(files.server_config, server_config(identities, passwords))
    for user in files.users:
        write_private(files.credentials(user), json.dumps({"user": user, "password": passwords[user]}) + "\n")
    return files


def write_private(path: Path, text: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)  # an existing folder too
    partial = path.with_name(path.name + ".partial")
    try:
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            os.fchmod(f.fileno(), 0o600)  # a leftover partial file keeps its old mode otherwise
            f.write(text)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
