"""Candidate pruning: the few instances of a role a router must look at to pick
the one it would pick among them all, found without a pass over every instance.

An idle prefill instance (no job booked on it) has an empty queue, so routing a
prompt there costs exactly its cost model's time for the part of the prompt it
lacks, times the instance's speed: among idle instances with the same cost
model, source of speed and cached prefix of the prompt, the fastest, then the
least loaded, then the smallest id is the best, and the others need not be
looked at. An idle decode instance (nothing booked, nothing in its batch)
likewise costs its cost model's step for a batch of one, times its speed. So a
router looks at the busy instances, the best idle holder of each prefix length
of the prompt (the KV index's match) and the best idle instance of each bucket
(one cost model, one source of speed). `RoleCandidates` keeps the idle instances
of one role in that order as the cluster changes, in heaps repaired lazily.

A key changes only when a heartbeat comes, a request is sent to the instance or
its speed takes a sample, and the cluster view and the margins report each
(`ClusterView.on_change`, `Margins.on_speed`); or when a speed learned from an
instance's own samples forgets its oldest one, at a time known in advance, when
the instance is filed again.
"""

import heapq
from collections.abc import Callable, Collection, Hashable, Iterable

from libs.protocol.ids import InstanceId
from libs.protocol.vocabulary import Role
from services.conductor.cluster import ClusterView, Instance
from services.conductor.margin import Margins

Key = tuple[Hashable, tuple]  # (bucket, order): the idle instances of one bucket compare by ``order`` alone
# an idle instance's key and when it may change by the clock alone (None: not by the clock); None: busy
IdleKey = tuple[Key, float | None] | None


def prefill_idle_key(p: Instance, margins: Margins) -> IdleKey:
    """Where an idle prefill instance stands among idle ones; None: it is busy."""
    if p.prefill.num_pending:
        return None
    model = id(p.cost)  # one object per cost model (`ClusterView._cost_of`)
    measured = p.heartbeat.prefill_speed
    if measured > 0:  # the speed its heartbeat says: fixed until the next one
        return ((model, "measured"), (measured, p.load, p.instance_id)), None
    own = margins.own_prefill_speed(p.instance_id)
    if own is not None:
        return ((model, "own"), (own[0], p.load, p.instance_id)), own[1]
    return ((model, "cluster"), (p.load, p.instance_id)), None  # every such instance has the cluster's speed


def decode_idle_key(d: Instance, margins: Margins) -> IdleKey:
    """Where an idle decode instance stands among idle ones; None: it is busy."""
    hb = d.heartbeat
    if d.decode.num_records or hb.batch_size or hb.context_tokens:
        return None
    own = margins.own_decode_speed(d.instance_id)
    if own is not None:
        return ((id(d.cost), "own"), (own[0], d.instance_id)), own[1]
    return ((id(d.cost), "cluster"), (d.instance_id,)), None


class RoleCandidates:
    """One role's instances split into busy ones (looked at always) and idle ones
    (in heaps by bucket, the best first), kept so as requests are booked, heartbeats
    come and speeds change (`touched`).

    Invariant: every live instance of the role that is idle by its key, and not
    marked busy, has an entry with its current key in its bucket's heap, and that
    key in ``_filed`` (stale entries may sit beside it; they are dropped when they
    come to the top)."""

    def __init__(self, view: ClusterView, role: str, key: Callable[[Instance], IdleKey]) -> None:
        self.view, self.role, self.key = view, role, key
        self._busy: dict[str, None] = {}  # an ordered set
        self._heaps: dict[Hashable, list[tuple[tuple, str]]] = {}
        self._filed: dict[str, Key] = {}  # instance -> the key of its newest heap entry
        self._entries = 0
        self._timers: list[tuple[float, str]] = []  # (when its key may change by the clock, instance)
        self._timer_at: dict[str, float] = {}  # instance -> its newest timer

    def touched(self, instance: Instance) -> None:
        """``instance`` was heard from, sent a request, or its speed changed: file it under its key now."""
        if instance.role != self.role:
            return
        idle = self.key(instance)
        if idle is None:
            self._busy[instance.instance_id] = None
        else:
            self._file(idle, instance.instance_id)

    def busy(self) -> list[Instance]:
        """The live busy instances; those found idle since are filed in the heaps."""
        out = []
        for instance_id in list(self._busy):
            instance = self._live(instance_id)
            idle = None if instance is None else self.key(instance)
            if instance is not None and idle is None:
                out.append(instance)
                continue
            del self._busy[instance_id]
            if idle is not None:
                self._file(idle, instance_id)
        return out

    def best_idle(self, skip: Collection[str] = ()) -> dict[Hashable, Instance]:
        """The best idle instance of each bucket, passing over those in ``skip``."""
        if self._entries > 2 * len(self.view.alive(self.role)) + 64:
            self._rebuild()
        out = {}
        for bucket, heap in self._heaps.items():
            passed = []
            while heap:
                order, instance_id = heap[0]
                current = self._filed.get(instance_id) == (bucket, order)
                instance = self._live(instance_id) if current else None
                idle = None if instance is None or instance_id in self._busy else self.key(instance)
                if idle is None or idle[0] != (bucket, order):
                    heapq.heappop(heap)  # stale: filed again under a newer key, gone, or busy
                    self._entries -= 1
                    if current:  # its only entry: busy again, it is filed anew once idle
                        del self._filed[instance_id]
                        if instance is not None:  # changed unannounced (its load set by hand): file it as it is
                            self.touched(instance)
                    continue
                if instance_id in skip:
                    passed.append(heapq.heappop(heap))
                    continue
                out[bucket] = instance
                break
            for entry in passed:
                heapq.heappush(heap, entry)
        return out

    def candidates(self, holders: Iterable[tuple[int, Iterable[str]]] = (), blocks: Callable[[str], int] = lambda i: 0,
                   skip: Collection[str] = (), monotone: bool = True) -> list[Instance]:  # fmt: skip
        """The instances a router must look at, none in ``skip``: the busy ones, the best
        idle one of each bucket, and of the idle instances in ``holders`` ((blocks of the
        prompt held, instances), longest first; ``blocks``: an instance's) the best of
        each bucket and length.

        ``monotone``: an idle instance costs no more for holding more of the prompt (no
        replication), so a bucket's best idle instance outranks every idle instance of
        its bucket holding no more than it does, and only longer holders are read."""
        self._wake()
        busy = self.busy()
        out = {i.instance_id: i for i in busy if i.instance_id not in skip}
        if monotone:
            tops = self.best_idle(skip)
            floor = {bucket: blocks(top.instance_id) for bucket, top in tops.items()}
        else:  # read every holder; the best idle instance of each bucket among the others
            holders = [(n, list(ids)) for n, ids in holders]
            held = {i for _, ids in holders for i in ids}
            tops = self.best_idle(held.union(skip) if held else skip)
            floor = {}
        # a bucket with no best idle instance has no idle instance outside ``skip``, holder or not
        lowest = min(floor.values(), default=float("inf")) if monotone else -1
        best: dict[tuple[Hashable, int], tuple[tuple, Instance]] = {}  # (bucket, length) -> its best idle holder
        filed, busy_ids, floor_of = self._filed, self._busy, floor.get  # read for every holder: bound once
        for n, ids in holders:
            if n <= lowest:
                break  # every bucket's best idle instance holds as much
            for instance_id in ids:
                key = filed.get(instance_id)
                if key is None or instance_id in busy_ids or instance_id in skip:
                    continue
                bucket, order = key
                if n <= floor_of(bucket, -1):
                    continue
                known = best.get((bucket, n))
                if (known is None or order < known[0]) and (instance := self._live(instance_id)):
                    best[(bucket, n)] = (order, instance)
        found_busy = [self._live(i) for i in list(self._busy)[len(busy):]]  # by best_idle, after busy() ran
        for instance in [*tops.values(), *(instance for _, instance in best.values()), *found_busy]:
            if instance is not None and instance.instance_id not in skip:
                out.setdefault(instance.instance_id, instance)
        return list(out.values())

    def _wake(self) -> None:
        """File again the instances whose key may have changed with the clock."""
        now = self.view.clock()
        timers = self._timers
        while timers and timers[0][0] < now:
            at, instance_id = heapq.heappop(timers)
            if self._timer_at.get(instance_id) != at:
                continue  # a newer timer stands for it
            del self._timer_at[instance_id]
            if (instance := self._live(instance_id)) is not None:
                self.touched(instance)

    def _live(self, instance_id: InstanceId) -> Instance | None:
        instance = self.view.get(instance_id)
        return instance if instance is not None and instance.role == self.role else None

    def _file(self, idle: tuple[Key, float | None], instance_id: InstanceId) -> None:
        key, changes_at = idle
        if changes_at is not None and self._timer_at.get(instance_id) != changes_at:
            heapq.heappush(self._timers, (changes_at, instance_id))
            self._timer_at[instance_id] = changes_at
        if self._filed.get(instance_id) == key:
            return  # its entry is in the heap already
        bucket, order = key
        heapq.heappush(self._heaps.setdefault(bucket, []), (order, instance_id))
        self._filed[instance_id] = key
        self._entries += 1

    def _rebuild(self) -> None:
        """Drop every stale entry at once (the heaps have grown past twice the instances)."""
        self._heaps.clear()
        self._filed.clear()
        self._entries = 0
        for instance in self.view.alive(self.role):
            if instance.instance_id not in self._busy:
                self.touched(instance)


class Candidates:
    """The prefill and decode candidates of one scheduler's view."""

    def __init__(self, view: ClusterView, margins: Margins) -> None:
        self.view = view
        self.prefill = RoleCandidates(view, Role.PREFILL, lambda p: prefill_idle_key(p, margins))
        self.decode = RoleCandidates(view, Role.DECODE, lambda d: decode_idle_key(d, margins))
        for role in (self.prefill, self.decode):
            for instance in view.alive(role.role):
                role.touched(instance)
        view.on_change.append(self.touched)
        margins.on_speed.append(self.speed_sampled)

    def touched(self, instance: Instance) -> None:
        self.prefill.touched(instance)
        self.decode.touched(instance)

    def speed_sampled(self, instance_id: InstanceId) -> None:
        instance = self.view.get(instance_id)
        if instance is not None:
            self.touched(instance)
