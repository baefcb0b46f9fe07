"""The conductor's view of the cluster, built from heartbeats alone.

An instance is alive from its first heartbeat until it has been silent for
``timeout`` seconds. Each carries its measured cost model (or a conservative
stand-in until it reports one) and what the conductor predicts it is busy with
(`load.py`). Between heartbeats the view counts the requests it has assigned to
each instance, so a burst of admissions does not all land on the instance that
looked idle a second ago. Pure logic: no NATS, an injectable clock.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.engine.cost_model import CostModel, uncalibrated_coefficients
from libs.protocol.schema import Heartbeat
from services.conductor.load import DecodeLoad, PrefillLoad


@dataclass
class Instance:
    heartbeat: Heartbeat
    last_seen: float
    cost: CostModel
    assigned_since_heartbeat: int = 0
    prefill: PrefillLoad = field(default_factory=PrefillLoad)
    decode: DecodeLoad = field(default_factory=DecodeLoad)

    @property
    def instance_id(self) -> str:
        return self.heartbeat.instance_id

    @property
    def role(self) -> str:
        return self.heartbeat.role

    @property
    def load(self) -> int:
        """Requests it reported, plus those sent to it since."""
        return self.heartbeat.load + self.assigned_since_heartbeat


class ClusterView:
    def __init__(
        self, timeout: float = 3.0, clock: Callable[[], float] = time.monotonic, block_size: int = 16
    ) -> None:
        self.timeout = timeout
        self.clock = clock
        self.block_size = block_size
        self._instances: dict[str, Instance] = {}
        self._by_role: dict[str, list[Instance]] = {}
        self.on_gone: Callable[[Instance], None] | None = None  # called for each instance forgotten
        self.last_fault = float("-inf")  # when an instance last restarted or went silent

    def observe(self, heartbeat: Heartbeat) -> Instance:
        now = self.clock()
        instance = self._instances.get(heartbeat.instance_id)
        if instance is None or instance.heartbeat.started_at != heartbeat.started_at:
            if instance is not None:  # the same instance, started again
                self.last_fault = now
            instance = Instance(heartbeat, now, self._cost_of(heartbeat))
            self._instances[heartbeat.instance_id] = instance
            self._by_role.clear()
        else:
            if heartbeat.cost != instance.heartbeat.cost:
                instance.cost = self._cost_of(heartbeat)
            instance.heartbeat, instance.last_seen = heartbeat, now
            if heartbeat.load == 0 and instance.assigned_since_heartbeat == 0:
                instance.prefill.clear(now)  # idle, and nothing can be on its way to it
            instance.assigned_since_heartbeat = 0
        if heartbeat.prefill_progress:
            instance.prefill.sync(heartbeat.prefill_progress, now)
        if heartbeat.chunk_tokens:  # a request on it is cut only between chunks of this many seconds
            chunk_s = instance.cost.prefill_time(heartbeat.chunk_tokens)
            instance.prefill.chunk_s = chunk_s * (heartbeat.prefill_speed or 1.0)
        return instance

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def alive(self, role: str) -> list[Instance]:
        """Instances of ``role`` heard from within the timeout, by id; forgets the silent."""
        now = self.clock()
        silent = [inst for inst in self._instances.values() if now - inst.last_seen > self.timeout]
        for inst in silent:
            self.last_fault = now
            del self._instances[inst.instance_id]
            self._by_role.clear()
            if self.on_gone is not None:
                self.on_gone(inst)
        instances = self._by_role.get(role)
        if instances is None:
            instances = sorted((i for i in self._instances.values() if i.role == role), key=lambda i: i.instance_id)
            self._by_role[role] = instances
        return instances

    def assigned(self, instance_id: str) -> None:
        instance = self._instances.get(instance_id)
        if instance is not None:
            instance.assigned_since_heartbeat += 1

    def _cost_of(self, heartbeat: Heartbeat) -> CostModel:
        if heartbeat.cost is not None:
            return CostModel(heartbeat.cost)
        block_size = heartbeat.contract.block_size if heartbeat.contract is not None else self.block_size
        return CostModel(uncalibrated_coefficients(block_size))
