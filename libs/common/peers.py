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

from libs.protocol.ids import InstanceId
from libs.protocol.schema import Heartbeat


class Deafness:
    """The stretch this process cannot hear its peers (its NATS connection is down), on
    ``clock``: silences are measured on `now`, which stands still meanwhile."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.since: float | None = None  # when hearing was lost; None while connected

    def now(self) -> float:
        return self.since if self.since is not None else self.clock()

    def begin(self) -> None:
        if self.since is None:
            self.since = self.clock()

    def end(self) -> Callable[[float], float] | None:
        """Hearing is back: moves a time something was last heard by the stretch spent deaf
        (never past now); None when hearing was not lost."""
        if self.since is None:
            return None
        now = self.clock()
        gap, self.since = now - self.since, None
        return lambda heard: min(heard + gap, now)


class PeerDirectory:
    def __init__(self, timeout: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.clock = clock
        self._seen: dict[str, tuple[Heartbeat, float]] = {}
        self._beats: dict[str, int] = {}  # heartbeats heard of each instance
        self._deafness = Deafness(clock)

    def now(self) -> float:
        """The clock silences are measured by: it stands still while this process is deaf."""
        return self._deafness.now()

    def deaf(self) -> None:
        """This process lost its NATS connection: nobody's silence counts until `hearing`."""
        self._deafness.begin()

    def hearing(self) -> None:
        """NATS is back: every instance's last hearing moves on by the time spent deaf."""
        if (moved := self._deafness.end()) is not None:
            self._seen = {i: (hb, moved(seen)) for i, (hb, seen) in self._seen.items()}

    def observe(self, heartbeat: Heartbeat) -> None:
        self._seen[heartbeat.instance_id] = (heartbeat, self.now())
        self._beats[heartbeat.instance_id] = self._beats.get(heartbeat.instance_id, 0) + 1

    def beats(self, instance_id: InstanceId) -> int:
        """How many heartbeats of ``instance_id`` were heard: a new one says it was heard again."""
        return self._beats.get(instance_id, 0)

    def last_heard(self, instance_id: InstanceId) -> tuple[Heartbeat, float] | None:
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
