"""Who a request is: its API key's tenant, and the KV cache scope its blocks are
named in. The tenants come from the tenants file (re-read when it changes, or on
SIGHUP) or, without one, from the single API key (or none) as one default tenant.

A request holds the `Tenant` it was authenticated as until it ends, so a reload
(a rotated key, a removed tenant) touches only requests that come after it.
The scope secret and the roots derived from it never leave the gateway but in
the requests to the workers; nothing here logs a key, a hash of one or a root.
"""

import asyncio
import logging
import os
import signal
from contextlib import AsyncExitStack
from pathlib import Path

from aiohttp import web

from libs.common import tenants as tenants_file
from libs.common.tenants import DEFAULT_TENANT, Tenant, Tenants, TenantsFileError
from libs.protocol.hashing import ROOT, BlockHash, scope_root
from services.gateway.errors import AuthenticationError, PermissionDeniedError

POLL_INTERVAL = 1.0  # seconds between looks at the tenants file's stat

log = logging.getLogger("kvserve.gateway.tenants")

TENANT = web.RequestKey("tenant", Tenant)  # who sent a request (the auth middleware's finding)

NO_KEY = ("You didn't provide an API key. Provide it in an Authorization header using Bearer auth "
          "(i.e. Authorization: Bearer YOUR_KEY).")  # fmt: skip


class TenantDirectory:
    """The tenants a gateway knows now. ``path``: the tenants file (None: ``api_key``
    alone, or no key at all, makes one default tenant in the default cache scope)."""

    def __init__(self, path: str | None = None, api_key: str | None = None) -> None:
        self.path = path
        self._api_key_tenants = tenants_file.single_key(api_key) if api_key is not None else None
        self._stat = None if path is None else _stat(path)  # before reading: a change meanwhile is read again
        self.tenants = tenants_file.single_key(api_key) if path is None else self._merged(tenants_file.read(path))
        self.reloads = 0

    @property
    def isolated(self) -> bool:
        """Each tenant in its own cache scope (a tenants file); else one scope for all, as without tenants."""
        return self.path is not None

    @property
    def needs_key(self) -> bool:
        return self.path is not None or self._api_key_tenants is not None

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header's bearer key; 401 for none or an
        unknown one, 403 for a disabled tenant's."""
        if not self.needs_key:
            return self.tenants.tenants[DEFAULT_TENANT]
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError(NO_KEY)
        tenant = self.tenants.find(token.strip())
        if tenant is None:
            raise AuthenticationError("Incorrect API key provided.")
        if tenant.disabled:
            raise PermissionDeniedError(f"The tenant of this API key ({tenant.name}) is disabled.")
        return tenant

    def hash_root(self, tenant: Tenant | None, cache_salt: str | None = None) -> BlockHash:
        """Where ``tenant``'s block chains start: its scope's root (ROOT without a tenants
        file, or without a tenant), narrowed by the request's ``cache_salt`` when it gives one."""
        root = scope_root(self.tenants.scope_bytes(tenant)) if self.isolated and tenant is not None else ROOT
        return root if cache_salt is None else scope_root(b"cache_salt/" + cache_salt.encode(), root)

    # --- reloading ----------------------------------------------------------------
    def reload(self) -> bool:
        """Read the file again (blocking); keep the tenants known when it cannot be read.
        True when the tenants changed."""
        assert self.path is not None
        stat = _stat(self.path)
        try:
            tenants = self._merged(tenants_file.read(self.path))
        except TenantsFileError as e:
            log.warning("the tenants file %s was not reloaded (the tenants known stay): %s", self.path, e)
            self._stat = stat
            return False
        self._stat = stat
        self.tenants = tenants  # one assignment: a request sees the old tenants or the new ones
        self.reloads += 1
        log.info("tenants reloaded from %s: %d tenants", self.path, len(tenants.tenants))
        return True

    def changed(self) -> bool:
        """Whether the file's stat differs from the one last read (blocking)."""
        return self.path is not None and _stat(self.path) != self._stat

    async def watch(self, stack: AsyncExitStack) -> None:
        """Reload on change (stat polled off the event loop) and on SIGHUP, until ``stack`` closes."""
        if self.path is None:
            return
        wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, wake.set)
        stack.callback(loop.remove_signal_handler, signal.SIGHUP)

        async def poll() -> None:
            while True:
                try:
                    async with asyncio.timeout(POLL_INTERVAL):
                        await wake.wait()
                except TimeoutError:
                    pass
                hup, _ = wake.is_set(), wake.clear()
                if hup or await asyncio.to_thread(self.changed):
                    await asyncio.to_thread(self.reload)

        task = asyncio.create_task(poll(), name="tenants-watch")
        stack.callback(task.cancel)

    def _merged(self, tenants: Tenants) -> Tenants:
        """The file's tenants, with the single API key's default tenant when there is one
        and the file does not name a tenant ``default`` itself."""
        extra = self._api_key_tenants
        if extra is None or DEFAULT_TENANT in tenants.tenants:
            return tenants
        return tenants_file.with_tenant(tenants, extra.tenants[DEFAULT_TENANT])


def _stat(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(Path(path))
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size
