"""The conductor's view of the cluster, built from heartbeats alone.

An instance is alive from its first heartbeat until it has been silent for
``timeout`` seconds. Each carries its measured cost model (or a conservative
stand-in until it reports one) and what the conductor predicts it is busy with
(`load.py`). Between heartbeats the view counts the requests it has assigned to
each instance, so a burst of admissions does not all land on the instance that
looked idle a second ago. Silence counts only while the conductor can hear: the
stretch its own NATS connection was lost (`deaf` to `hearing`) is taken out of
every instance's. Pure logic: no NATS, an injectable clock.
"""

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from libs.common.peers import Deafness
from libs.engine.cost_model import CostModel, uncalibrated_coefficients
from libs.protocol.ids import InstanceId
from libs.protocol.schema import Heartbeat, PrefillBeat
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
        # every instance's id, the one heard from longest ago first: finding the silent reads
        # only those, never the whole cluster (it runs inside an admission)
        self._heard: OrderedDict[str, None] = OrderedDict()
        self._by_role: dict[str, list[Instance]] = {}
        self._costs: dict[bytes, CostModel] = {}  # by encoded coefficients: few (one per kind of worker)
        self.on_gone: Callable[[Instance], None] | None = None  # called for each instance forgotten
        # told of every instance that may have changed: a new heartbeat came, or a request was sent to it
        # (`candidates.py`)
        self.on_change: list[Callable[[Instance], None]] = []
        # when an instance last restarted, went silent or said it was still warming up: what ran
        # about then teaches admission nothing (`Admitter._teaches`)
        self.last_disturbance = float("-inf")
        self.roles_seen: set[str] = set()  # every role an instance was ever heard in, alive or not
        self._deafness = Deafness(clock)

    def deaf(self) -> None:
        """The conductor lost NATS: no instance is forgotten for its silence until `hearing`."""
        self._deafness.begin()

    def hearing(self) -> None:
        """NATS is back: every instance's last hearing moves on by the time spent deaf."""
        if (moved := self._deafness.end()) is not None:
            for instance in self._instances.values():  # an order-keeping move: ``_heard`` stays right
                instance.last_seen = moved(instance.last_seen)

    def _hear(self, instance: Instance, now: float) -> None:
        instance.last_seen = now
        try:
            self._heard.move_to_end(instance.heartbeat.instance_id)
        except KeyError:  # new
            self._heard[instance.heartbeat.instance_id] = None

    def observe(self, heartbeat: Heartbeat) -> Instance:
        now = self.clock()
        instance = self._instances.get(heartbeat.instance_id)
        if (instance is not None and heartbeat is instance.heartbeat and not instance.assigned_since_heartbeat
                and not instance.prefill.num_pending):  # fmt: skip
            # the very beat it sent last, and nothing sent to it since (the simulator repeats an idle
            # instance's beat): it is only heard from again
            self._hear(instance, now)
            return instance
        changed = True
        if heartbeat.warming:
            self.last_disturbance = now
        if instance is None or instance.heartbeat.started_at != heartbeat.started_at:
            if instance is not None:  # the same instance, started again
                self.last_disturbance = now
            instance = Instance(heartbeat, now, self._cost_of(heartbeat))
            self._instances[heartbeat.instance_id] = instance
            self._hear(instance, now)
            self.roles_seen.add(heartbeat.role)
            self._by_role.clear()
        else:
            changed = heartbeat is not instance.heartbeat or instance.assigned_since_heartbeat > 0
            if heartbeat is not instance.heartbeat:
                if heartbeat.cost != instance.heartbeat.cost:
                    instance.cost = self._cost_of(heartbeat)
                instance.heartbeat = heartbeat
            self._hear(instance, now)
            if not instance.assigned_since_heartbeat and instance.prefill.num_pending and heartbeat.load == 0:
                instance.prefill.clear(now)  # idle, and nothing can be on its way to it
                changed = True
            instance.assigned_since_heartbeat = 0
        payload = heartbeat.payload
        if isinstance(payload, PrefillBeat) and payload.progress:
            instance.prefill.sync(payload.progress, now)
        if chunk_tokens := heartbeat.chunk_tokens:  # a request on it is cut only between chunks of this many seconds
            instance.prefill.chunk_s = instance.cost.prefill_time(chunk_tokens) * (heartbeat.prefill_speed or 1.0)
        if changed:
            for listener in self.on_change:
                listener(instance)
        return instance

    def observe_all(self, heartbeats: Iterable[Heartbeat]) -> None:
        """`observe` each of ``heartbeats`` (a batch that came at one moment): an instance
        that sent again the very beat it sent last, with nothing sent to it since, is
        only marked heard from."""
        now = self.clock()
        instances, heard = self._instances, self._heard
        for heartbeat in heartbeats:
            instance = instances.get(heartbeat.instance_id)
            if (instance is not None and heartbeat is instance.heartbeat and not instance.assigned_since_heartbeat
                    and not instance.prefill.num_pending):  # fmt: skip
                instance.last_seen = now  # `_hear`, inlined: every instance, every second
                heard.move_to_end(heartbeat.instance_id)
            else:
                self.observe(heartbeat)

    def get(self, instance_id: InstanceId) -> Instance | None:
        return self._instances.get(instance_id)

    def alive(self, role: str) -> list[Instance]:
        """Instances of ``role`` heard from within the timeout, by id; forgets the silent."""
        now = self.clock()
        heard, timeout = self._heard, self.timeout
        while heard and self._deafness.since is None:  # the silent: those heard from longest ago
            inst = self._instances[next(iter(heard))]
            if now - inst.last_seen <= timeout:
                break
            heard.popitem(last=False)
            self.last_disturbance = now
            del self._instances[inst.instance_id]
            self._by_role.clear()
            if self.on_gone is not None:
                self.on_gone(inst)
        instances = self._by_role.get(role)
        if instances is None:
            instances = sorted((i for i in self._instances.values() if i.role == role), key=lambda i: i.instance_id)
            self._by_role[role] = instances
        return instances

    def assigned(self, instance_id: InstanceId) -> None:
        instance = self._instances.get(instance_id)
        if instance is not None:
            instance.assigned_since_heartbeat += 1
            for listener in self.on_change:
                listener(instance)

    def _cost_of(self, heartbeat: Heartbeat) -> CostModel:
        """The instance's cost model: one object for every instance reporting the same
        coefficients (routing compares the instances of one cost model by speed alone)."""
        if heartbeat.cost is not None:
            coefficients = heartbeat.cost
        else:
            block_size = heartbeat.contract.block_size if heartbeat.contract is not None else self.block_size
            coefficients = uncalibrated_coefficients(block_size)
        key = msgspec.msgpack.encode(coefficients)
        cost = self._costs.get(key)
        if cost is None:
            cost = self._costs[key] = CostModel(coefficients)
        return cost
