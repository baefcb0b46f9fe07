"""Two-phase puts between their phases: the slots handed to a caller, the write
ticket they may fill, and the deadline after which an uncommitted put gives its
slots back. Blocks of a put are invisible until it commits.
"""

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from libs.protocol.hashing import BlockHash
from libs.protocol.schema.contracts import CacheOwner

# Slots go back this long after their ticket expired: a TCP frame accepted just
# before the deadline may still be landing in them.
FREE_GRACE_S = 5.0


@dataclass
class PendingPut:
    put_id: str
    hashes: list[BlockHash]
    slots: list[int]
    pin: bool
    token: str  # the write ticket's
    timer: asyncio.TimerHandle | None = None
    owner: CacheOwner | None = None  # whose blocks (a tenant's cache scope)


class PendingPuts:
    def __init__(self, on_expired: Callable[[PendingPut], None], grace_s: float = FREE_GRACE_S) -> None:
        self._pending: dict[str, PendingPut] = {}
        self._on_expired = on_expired
        self.grace_s = grace_s

    def __len__(self) -> int:
        return len(self._pending)

    def open(self, hashes: list[BlockHash], slots: list[int], pin: bool, token: str, ttl_s: float,
             owner: CacheOwner | None = None) -> PendingPut:  # fmt: skip
        put = PendingPut(secrets.token_hex(8), hashes, slots, pin, token, owner=owner)
        put.timer = asyncio.get_running_loop().call_later(ttl_s + self.grace_s, self._expire, put.put_id)
        self._pending[put.put_id] = put
        return put

    def take(self, put_id: str) -> PendingPut | None:
        """The put, now out of the table (to commit it), or None if unknown or expired."""
        put = self._pending.pop(put_id, None)
        if put is not None and put.timer is not None:
            put.timer.cancel()
        return put

    def _expire(self, put_id: str) -> None:
        put = self._pending.pop(put_id, None)
        if put is not None:
            self._on_expired(put)

    def expire_all(self) -> None:
        for put_id in list(self._pending):
            self.take(put_id)
