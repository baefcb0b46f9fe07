"""The conductor's view of the cluster, built from heartbeats alone.

An instance is alive from its first heartbeat until it has been silent for
``timeout`` seconds. Between heartbeats the view counts the requests it has
assigned to each instance, so a burst of admissions does not all land on the
instance that looked idle a second ago. Pure logic: no NATS, an injectable clock.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.common.schema import Heartbeat


@dataclass
class Instance:
    heartbeat: Heartbeat
    last_seen: float
    assigned_since_heartbeat: int = field(default=0)

    @property
    def instance_id(self) -> str:
        return self.heartbeat.instance_id

    @property
    def load(self) -> int:
        """Requests it reported, plus those sent to it since."""
        return self.heartbeat.load + self.assigned_since_heartbeat


class ClusterView:
    def __init__(self, timeout: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.clock = clock
        self._instances: dict[str, Instance] = {}

    def observe(self, heartbeat: Heartbeat) -> None:
        self._instances[heartbeat.instance_id] = Instance(heartbeat, self.clock())

    def alive(self, role: str) -> list[Instance]:
        """Instances of ``role`` heard from within the timeout, by id; forgets the silent."""
        now = self.clock()
        for instance_id in [i for i, inst in self._instances.items() if now - inst.last_seen > self.timeout]:
            del self._instances[instance_id]
        return sorted((i for i in self._instances.values() if i.heartbeat.role == role), key=lambda i: i.instance_id)

    def assigned(self, instance_id: str) -> None:
        instance = self._instances.get(instance_id)
        if instance is not None:
            instance.assigned_since_heartbeat += 1
