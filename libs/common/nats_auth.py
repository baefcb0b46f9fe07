"""Who may say what on NATS: one user per kvserve role, the subjects it may publish and
subscribe to, and the files that carry the secrets.

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
from dataclasses import dataclass, field
from pathlib import Path

from libs.common import subjects as s
from libs.common.vocabulary import Role

log = logging.getLogger("kvserve.nats")

SERVICE_ROLES = tuple(Role)
# observer: watches heartbeats and reads metrics (`kvserve up`'s own watcher);
# admin: every subject, for an operator's tools and tests, never given to a service.
OBSERVER, ADMIN = "observer", "admin"
USERS = SERVICE_ROLES + (OBSERVER, ADMIN)
SERVER_CONFIG = Path("nats-server") / "nats.conf"  # under the auth directory
CREDENTIALS = "credentials.json"  # under the auth directory, in a folder per user
MIN_SECRET_LENGTH = 16


class NatsAuthError(ValueError):
    """A credentials file or secret that cannot be used."""


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool = True  # may answer the requests it receives (on their reply subjects only)


def inbox_prefix(user: str) -> str:
    """Where a user's request replies arrive: one prefix per user, so no role reads another's replies."""
    return f"_INBOX.{user}"


# The users that send requests a service answers. A service may publish to their inboxes
# outright, not only through allow_responses: nats-server forgets which replies a client
# owes when it reconnects, so without this an answer computed across a NATS restart is
# refused and its requester waits out its timeout. Reading an inbox stays its owner's alone.
REQUESTERS = (Role.GATEWAY, Role.CONDUCTOR, Role.PREFILL, OBSERVER)


def _service(role: Role, publish: tuple[str, ...], subscribe: tuple[str, ...], requests: bool) -> Permissions:
    """What every service does (heartbeats, roll calls, metrics, replies) plus what ``role`` does."""
    inbox = (inbox_prefix(role) + ".>",) if requests else ()
    replies = tuple(inbox_prefix(user) + ".>" for user in REQUESTERS)
    return Permissions(
        publish=(s.heartbeat(role), s.ROLL_CALL) + publish + replies,
        subscribe=(s.ROLL_CALL, s.METRICS_ALL) + subscribe + inbox,
    )


PERMISSIONS: dict[str, Permissions] = {
    # The gateway alone admits and submits requests, cancels them and reads their tokens.
    Role.GATEWAY: _service(
        Role.GATEWAY,
        publish=(s.CONDUCTOR_ADMIT, s.CONDUCTOR_PROGRESS, s.PREFILL_SUBMIT_ALL, s.DECODE_PREFILL_ALL, s.CANCEL,
                 s.METRICS_ALL, s.CONDUCTOR_VIEW_ALL),
        subscribe=(s.HEARTBEAT_ALL, s.TOKENS_ALL),
        requests=True,
    ),  # fmt: skip
    Role.CONDUCTOR: _service(
        Role.CONDUCTOR,
        publish=(s.KV_SNAPSHOT_ALL, s.CONDUCTOR_ADMITTED),
        subscribe=(s.HEARTBEAT_ALL, s.KV_EVENTS_ALL, s.CONDUCTOR_PROGRESS, s.CONDUCTOR_ADMIT, s.CONDUCTOR_VIEW_ALL,
                   s.CONDUCTOR_ADMITTED),
        requests=True,
    ),
    # Prefill and decode workers alone publish tokens.
    Role.PREFILL: _service(
        Role.PREFILL,
        publish=(s.TOKENS_ALL, s.DECODE_RESERVE_ALL, s.DECODE_ADMIT_ALL, s.DECODE_RELEASE_ALL, s.STORE_OPS_ALL,
                 s.KV_EVENTS_ALL),
        subscribe=(s.PREFILL_SUBMIT_ALL, s.CANCEL, s.heartbeat(Role.DECODE), s.heartbeat(Role.STORE), s.KV_SNAPSHOT_ALL),
        requests=True,
    ),  # fmt: skip
    Role.DECODE: _service(
        Role.DECODE,
        publish=(s.TOKENS_ALL,),
        subscribe=(s.DECODE_RESERVE_ALL, s.DECODE_ADMIT_ALL, s.DECODE_RELEASE_ALL, s.DECODE_PREFILL_ALL, s.CANCEL),
        requests=False,
    ),
    Role.STORE: _service(
        Role.STORE,
        publish=(s.KV_EVENTS_ALL,),
        subscribe=(s.STORE_OPS_ALL, s.KV_SNAPSHOT_ALL),
        requests=False,
    ),
    OBSERVER: Permissions(
        publish=(s.METRICS_ALL,),
        subscribe=(s.HEARTBEAT_ALL, inbox_prefix(OBSERVER) + ".>"),
        responds=False,
    ),
    ADMIN: Permissions(publish=(">",), subscribe=(">",), responds=False),
}


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

def redact_url(url: str) -> str:
    """A NATS URL (or comma-separated URLs) without credentials, for logs."""
    redacted = []
    for one in url.split(","):
        head, at, host = one.rpartition("@")
        scheme = head.split("://", 1)[0] + "://" if "://" in head else ""
        redacted.append(f"{scheme}***@{host}" if at else one)
    return ",".join(redacted)


# --- the files ----------------------------------------------------------------------
def random_passwords() -> dict[str, str]:
    return {user: secrets.token_urlsafe(24) for user in USERS}


def derived_passwords(secret: str) -> dict[str, str]:
    """Every user's password from one secret (HMAC-SHA256), so a deployment keeps one secret
    and gets the same files each time it writes them."""
    if len(secret) < MIN_SECRET_LENGTH:
        raise NatsAuthError(f"the NATS secret must be at least {MIN_SECRET_LENGTH} characters")
    key = secret.encode()
    return {
        user: urlsafe_b64encode(hmac.new(key, f"kvserve-nats/{user}".encode(), hashlib.sha256).digest())
        .decode()
        .rstrip("=")
        for user in USERS
    }


def server_config(passwords: dict[str, str]) -> str:
    """nats-server's authorization block: every user with its password and permissions."""
    users = []
    for user in USERS:
        grants = PERMISSIONS[user]
        permissions: dict = {"publish": {"allow": list(grants.publish)}, "subscribe": {"allow": list(grants.subscribe)}}
        if grants.responds:
            permissions["allow_responses"] = True
        users.append({"user": user, "password": passwords[user], "permissions": permissions})
    body = json.dumps({"authorization": {"users": users}}, indent=2)
    return f"# kvserve's NATS users, one per role (see libs/common/nats_auth.py). Keep this file 0600.\n{body}\n"


@dataclass(frozen=True)
class AuthFiles:
    """Where `write_auth_files` put nats-server's configuration and each user's credentials."""

    directory: Path

    @property
    def server_config(self) -> Path:
        return self.directory / SERVER_CONFIG

    def credentials(self, user: str) -> Path:
        if user not in USERS:
            raise KeyError(f"no NATS user {user!r}; there are {', '.join(USERS)}")
        return self.directory / user / CREDENTIALS


def write_auth_files(directory: str | Path, passwords: dict[str, str]) -> AuthFiles:
    """Write ``directory/nats-server/nats.conf`` and ``directory/<user>/credentials.json``
    for every user: each folder 0700, each file 0600, whole or not at all."""
    files = AuthFiles(Path(directory))
    files.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new one private too
    _write_private(files.server_config, server_config(passwords))
    for user in USERS:
        _write_private(files.credentials(user), json.dumps({"user": user, "password": passwords[user]}) + "\n")
    return files


def _write_private(path: Path, text: str) -> None:
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
