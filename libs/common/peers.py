"""Who else is in the cluster, from heartbeats: the live instances of a role.

For a worker that must pick a peer on its own (a prefill worker retrying a
hand-off on another decode worker) and for the gateway, which watches the workers
serving its requests; the conductor keeps its own, richer view.

Silence counts only while this process can hear: between its own NATS
connection's loss (`deaf`) and return (`hearing`) no heartbeat can arrive, so
that stretch is taken out of every instance's silence (a 2-second outage of
NATS is not 2 seconds of every worker's silence).
"""

import time
from collections.abc import Callable

from libs.protocol.schema import Heartbeat


class PeerDirectory:
    def __init__(self, timeout: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.clock = clock
        self._seen: dict[str, tuple[Heartbeat, float]] = {}
        self._beats: dict[str, int] = {}  # heartbeats heard of each instance
        self._deaf_since: float | None = None  # when this process lost NATS; None while connected

    def now(self) -> float:
        """The clock silences are measured by: it stands still while this process is deaf."""
        return self._deaf_since if self._deaf_since is not None else self.clock()

    def deaf(self) -> None:
        """This process lost its NATS connection: nobody's silence counts until `hearing`."""
        if self._deaf_since is None:
            self._deaf_since = self.clock()

    def hearing(self) -> None:
        """NATS is back: every instance's last hearing moves on by the time spent deaf."""
        if self._deaf_since is None:
            return
        now = self.clock()
        gap, self._deaf_since = now - self._deaf_since, None
        self._seen = {i: (hb, min(seen + gap, now)) for i, (hb, seen) in self._seen.items()}

    def observe(self, heartbeat: Heartbeat) -> None:
        self._seen[heartbeat.instance_id] = (heartbeat, self.now())
        self._beats[heartbeat.instance_id] = self._beats.get(heartbeat.instance_id, 0) + 1

    def beats(self, instance_id: str) -> int:
        """How many heartbeats of ``instance_id`` were heard: a new one says it was heard again."""
        return self._beats.get(instance_id, 0)

    def last_heard(self, instance_id: str) -> tuple[Heartbeat, float] | None:
        """The last heartbeat of ``instance_id`` and when it came (by ``clock``); None if never heard."""
        return self._seen.get(instance_id)

    def silent_for(self, role: str) -> float | None:
        """Seconds since any instance of ``role`` was last heard; None if none ever was."""
        times = [seen for hb, seen in self._seen.values() if hb.role == role]
        return self.now() - max(times) if times else None

    def heard(self) -> list[tuple[Heartbeat, float]]:
        """Every instance heard from within ``timeout``, with the seconds since its last heartbeat."""
        now = self.now()
        return [(hb, now - seen) for hb, seen in self._seen.values() if now - seen <= self.timeout]

    def alive(self, role: str, exclude: set[str] = frozenset()) -> list[Heartbeat]:
        """Live instances of ``role`` not in ``exclude``, least loaded first."""
        now = self.now()
        live = [hb for hb, seen in self._seen.values() if now - seen <= self.timeout]
        return sorted(
            (hb for hb in live if hb.role == role and hb.instance_id not in exclude),
            key=lambda hb: (hb.load, -hb.free_blocks, hb.instance_id),
        )
