"""The tenants file: who may use the cluster, with which API keys, at what weight,
under which quotas and in which KV cache scope. Read with the stdlib `tomllib`;
written (by `kvserve tenants`) atomically, mode 0600.

Keys are stored only as ``sha256:<hex>`` of the key; a key is high-entropy, so
that is enough to check one (`Tenants.find`, constant time per stored key) and
useless to whoever reads the file. ``scope_secret`` (random, written once) makes
each tenant's cache scope unguessable; it never leaves the gateway.

    scope_secret = "9f3c..."
    [tenants.alice]
    keys = ["sha256:..."]
    weight = 2.0
    requests_per_minute = 600
    tokens_per_minute = 200000
    max_concurrent = 16
    max_prompt_tokens = 8192
    cache_scope = "public-prompts"   # optional: share KV with every tenant naming it
    store_share = 0.25               # optional: the most of each store's DRAM its blocks keep when it is full
    disabled = false
    admin = true                     # optional: sees every tenant in /console and `kvserve status`
"""

import hashlib
import hmac
import os
import re
import secrets
import tempfile
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from libs.protocol.schema.contracts import CacheOwner

KEY_PREFIX = "kvs-"
HASH_PREFIX = "sha256:"
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
QUOTA_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "max_prompt_tokens")
DEFAULT_TENANT = "default"  # the tenant of a cluster with no tenants file (one API key, or none)


class TenantsFileError(ValueError):
    """The tenants file cannot be read as one."""


@dataclass(frozen=True)
class Quotas:
    requests_per_minute: int | None = None  # None: no limit
    tokens_per_minute: int | None = None  # prompt + completion
    max_concurrent: int | None = None
    max_prompt_tokens: int | None = None


@dataclass(frozen=True)
class Tenant:
    name: str
    key_hashes: tuple[str, ...] = ()
    weight: float = 1.0
    quotas: Quotas = field(default_factory=Quotas)
    cache_scope: str | None = None  # a named scope shared with other tenants; None: its own
    disabled: bool = False
    admin: bool = False  # sees every tenant's usage in the console and `kvserve status`; else only its own
    store_share: float | None = None  # of each store's DRAM, the most its scope's blocks keep when room is needed

    def __repr__(self) -> str:  # never the key hashes, even in a traceback
        return f"Tenant({self.name!r}, weight={self.weight}, disabled={self.disabled})"


@dataclass(frozen=True)
class Tenants:
    tenants: dict[str, Tenant]
    scope_secret: bytes = b""

    def find(self, key: str) -> Tenant | None:
        """The tenant holding API key ``key``, or None."""
        digest = hash_key(key)
        found = None
        for tenant in self.tenants.values():
            for stored in tenant.key_hashes:
                if hmac.compare_digest(stored, digest):  # every stored key is compared: no early exit
                    found = tenant
        return found

    def scope_bytes(self, tenant: Tenant) -> bytes:
        """The secret naming ``tenant``'s KV cache scope (its own, or the shared one it joined)."""
        label = f"shared/{tenant.cache_scope}" if tenant.cache_scope else f"tenant/{tenant.name}"
        return hmac.new(self.scope_secret or b"kvserve/tenant-scope", label.encode(), hashlib.sha256).digest()

    @staticmethod
    def cache_owner(tenant: Tenant) -> CacheOwner:
        """Whose ``tenant``'s blocks are in the stores: its scope's name, not its secret
        (``tenant/<name>``, or ``shared/<scope>`` for a shared scope), with its store share."""
        name = f"shared/{tenant.cache_scope}" if tenant.cache_scope else f"tenant/{tenant.name}"
        return CacheOwner(name=name, share=tenant.store_share)


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def single_key(key: str | None) -> Tenants:
    """The one-tenant setup of ``--api-key`` (or of no key at all: every request is the default tenant's).
    Its tenant is an admin: whoever holds the deployment's one key runs it."""
    keys = (hash_key(key),) if key is not None else ()
    return Tenants({DEFAULT_TENANT: Tenant(DEFAULT_TENANT, keys, admin=True)})  # the operator's own key


def parse(text: str) -> Tenants:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TenantsFileError(f"not TOML: {e}") from None
    secret = data.get("scope_secret", "")
    if not isinstance(secret, str):
        raise TenantsFileError("scope_secret must be a string")
    table = data.get("tenants", {})
    if not isinstance(table, dict):
        raise TenantsFileError("[tenants] must be a table of tenants")
    return Tenants({name: _tenant(name, entry) for name, entry in table.items()}, secret.encode())


def _tenant(name: str, entry: object) -> Tenant:
    if not NAME.match(name):
        raise TenantsFileError(f"tenant name {name!r}: letters, digits, '_', '.', '-' only (at most 64)")
    if not isinstance(entry, dict):
        raise TenantsFileError(f"tenants.{name} must be a table")
    known = {"keys", "weight", "cache_scope", "disabled", "admin", "store_share", *QUOTA_FIELDS}
    if unknown := sorted(set(entry) - known):
        raise TenantsFileError(f"tenants.{name}: unknown field(s) {', '.join(unknown)}")
    keys = entry.get("keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and k.startswith(HASH_PREFIX) for k in keys):
        raise TenantsFileError(f"tenants.{name}.keys must be a list of '{HASH_PREFIX}<hex>' key hashes")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise TenantsFileError(f"tenants.{name}.weight must be a positive number")
    quotas = {}
    for quota in QUOTA_FIELDS:
        value = entry.get(quota)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TenantsFileError(f"tenants.{name}.{quota} must be a positive integer")
        quotas[quota] = value
    scope = entry.get("cache_scope")
    if scope is not None and (not isinstance(scope, str) or not NAME.match(scope)):
        raise TenantsFileError(f"tenants.{name}.cache_scope must be a name (letters, digits, '_', '.', '-')")
    disabled = entry.get("disabled", False)
    if not isinstance(disabled, bool):
        raise TenantsFileError(f"tenants.{name}.disabled must be true or false")
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise TenantsFileError(f"tenants.{name}.admin must be true or false")
    share = entry.get("store_share")
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
        raise TenantsFileError(f"tenants.{name}.store_share must be a number in (0, 1]")
    return Tenant(name, tuple(keys), float(weight), Quotas(**quotas), scope, disabled, admin,
                  None if share is None else float(share))  # fmt: skip


def read(path: str | Path) -> Tenants:
    """The tenants file at ``path`` (blocking)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TenantsFileError(f"cannot read {path}: {e.strerror}") from None
    return parse(text)


def dumps(tenants: Tenants) -> str:
    lines = ["# kvserve tenants (kvserve tenants add|list|rotate-key|remove). Keys are stored as sha256 only.",
             f'scope_secret = "{tenants.scope_secret.decode()}"  # names each tenant\'s KV cache scope: keep it secret',
             ""]  # fmt: skip
    for t in tenants.tenants.values():
        lines.append(f"[tenants.{t.name}]")
        lines.append("keys = [" + ", ".join(f'"{k}"' for k in t.key_hashes) + "]")
        lines.append(f"weight = {t.weight!r}")
        for quota in QUOTA_FIELDS:
            if (value := getattr(t.quotas, quota)) is not None:
                lines.append(f"{quota} = {value}")
        if t.cache_scope is not None:
            lines.append(f'cache_scope = "{t.cache_scope}"')
        if t.disabled:
            lines.append("disabled = true")
        if t.admin:
            lines.append("admin = true")
        if t.store_share is not None:
            lines.append(f"store_share = {t.store_share!r}")
        lines.append("")
    return "\n".join(lines)


def write(path: str | Path, tenants: Tenants) -> None:
    """Replace the file at ``path`` with ``tenants`` atomically (a reader sees the old
    file or the new one), readable by its owner only."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps(tenants))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def new_secret() -> bytes:
    return secrets.token_hex(32).encode()


def with_tenant(tenants: Tenants, tenant: Tenant) -> Tenants:
    return replace(tenants, tenants={**tenants.tenants, tenant.name: tenant})
