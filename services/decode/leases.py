"""Leases on KV blocks reserved for a request whose KV is still on its way.

A prefill worker reserves blocks, writes the prompt's KV into them, then hands
the request over. If the hand-over never comes (the prefill died, the client
left), the lease expires and its blocks return to the pool: a reservation can
never leak. Pure bookkeeping with an injectable clock.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

from libs.protocol.ids import RequestId


@dataclass
class Lease:
    request_id: RequestId
    block_ids: list[int]
    expires_at: float
    ticket_token: str | None = None  # the transfer ticket that may write into the blocks


class LeaseTable:
    def __init__(self, lease_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_seconds = lease_seconds
        self.clock = clock
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._leases

    def grant(self, request_id: RequestId, block_ids: list[int], ticket_token: str | None = None) -> Lease:
        lease = Lease(request_id, block_ids, self.clock() + self.lease_seconds, ticket_token)
        self._leases[request_id] = lease
        return lease

    def take(self, request_id: RequestId) -> Lease | None:
        """Remove and return a live lease (the hand-over arrived)."""
        return self._leases.pop(request_id, None)

    def expired(self) -> list[Lease]:
        """Remove and return every lease past its expiry."""
        now = self.clock()
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self._leases[lease.request_id]
        return gone

    @property
    def num_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self._leases.values())
