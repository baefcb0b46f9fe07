"""Whether the workers one attempt of a request depends on are still alive, from
the heartbeats the gateway hears (a PeerDirectory).

A watched instance is gone once it has been silent for ``silence`` seconds (about
two and a half heartbeats: faster than the conductor, which waits three) or has
restarted under the same id (a new start time: the request died with the old
process). An instance never heard from is not watched; the token timeout is its
only guard. Pure logic: no NATS, the directory's clock.
"""

import math
from dataclasses import dataclass

from libs.common.peers import PeerDirectory
from libs.protocol.ids import InstanceId
from libs.protocol.vocabulary import Role

LOST_AFTER_HEARTBEATS = 2.5  # silence, in heartbeat intervals, after which a worker counts as gone


@dataclass(frozen=True)
class Gone:
    instance_id: InstanceId
    role: Role  # PREFILL or DECODE
    why: str  # for the log and the error message
    started_at: float  # the start time of the process seen gone (a restarted one has another)
    restarted: bool = False  # else only silent: it may be heard from again


class WorkerWatch:
    def __init__(self, peers: PeerDirectory, silence: float) -> None:
        self.peers = peers
        self.silence = silence
        self._watched: dict[str, tuple[str, float]] = {}  # instance id -> (role, its start time when first watched)

    @property
    def watched(self) -> dict[str, str]:
        """Instance id -> role, of every instance watched now."""
        return {instance_id: role for instance_id, (role, _) in self._watched.items()}

    def watch(self, instance_id: InstanceId, role: str) -> None:
        heard = self.peers.last_heard(instance_id)
        if heard is not None and instance_id not in self._watched:
            self._watched[instance_id] = (role, heard[0].started_at)

    def started_at(self, instance_id: InstanceId) -> float | None:
        """The start time of the process watched under ``instance_id``; None if not watched."""
        watched = self._watched.get(instance_id)
        return watched[1] if watched is not None else None

    def unwatch(self, instance_id: InstanceId) -> None:
        self._watched.pop(instance_id, None)

    def gone(self) -> Gone | None:
        """The first watched instance that is gone, if any."""
        now = self.peers.now()
        for instance_id, (role, started_at) in self._watched.items():
            heartbeat, seen = self.peers.last_heard(instance_id)
            if heartbeat.started_at != started_at:
                return Gone(instance_id, role, "restarted", started_at, restarted=True)
            if now - seen >= self.silence:
                return Gone(instance_id, role, f"no heartbeat for {now - seen:.1f}s", started_at)
        return None

    def seconds_to_next_check(self) -> float:
        """How long until a watched instance counts as gone unless it is heard from
        again (0: one may be gone already); infinite when nothing is watched."""
        now = self.peers.now()
        deadlines = [self.peers.last_heard(i)[1] + self.silence for i in self._watched]
        return max(0.0, min(deadlines) - now) if deadlines else math.inf
