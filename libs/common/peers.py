"""Who else is in the cluster, from heartbeats: the live instances of a role.

For a worker that must pick a peer on its own (a prefill worker retrying a
hand-off on another decode worker) and for the gateway, which watches the workers
serving its requests; the conductor keeps its own, richer view.
"""

import time
from collections.abc import Callable

from libs.protocol.schema import Heartbeat


class PeerDirectory:
    def __init__(self, timeout: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.clock = clock
        self._seen: dict[str, tuple[Heartbeat, float]] = {}

    def observe(self, heartbeat: Heartbeat) -> None:
        self._seen[heartbeat.instance_id] = (heartbeat, self.clock())

    def last_heard(self, instance_id: str) -> tuple[Heartbeat, float] | None:
        """The last heartbeat of ``instance_id`` and when it came (by ``clock``); None if never heard."""
        return self._seen.get(instance_id)

    def silent_for(self, role: str) -> float | None:
        """Seconds since any instance of ``role`` was last heard; None if none ever was."""
        times = [seen for hb, seen in self._seen.values() if hb.role == role]
        return self.clock() - max(times) if times else None

    def heard(self) -> list[tuple[Heartbeat, float]]:
        """Every instance heard from within ``timeout``, with the seconds since its last heartbeat."""
        now = self.clock()
        return [(hb, now - seen) for hb, seen in self._seen.values() if now - seen <= self.timeout]

    def alive(self, role: str, exclude: set[str] = frozenset()) -> list[Heartbeat]:
        """Live instances of ``role`` not in ``exclude``, least loaded first."""
        now = self.clock()
        live = [hb for hb, seen in self._seen.values() if now - seen <= self.timeout]
        return sorted(
            (hb for hb in live if hb.role == role and hb.instance_id not in exclude),
            key=lambda hb: (hb.load, -hb.free_blocks, hb.instance_id),
        )
