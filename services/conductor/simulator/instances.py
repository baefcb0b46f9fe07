"""Simulated instances: what a prefill worker, a decode worker and a store do,
in simulated time, with their durations taken from a cost model.

A prefill instance reuses each prompt's prefix from its own block cache (LRU),
loads what the store holds next, copies a peer's blocks when the conductor said
so, computes the rest and hands the KV over, a chunk at a time in the order a
prefill worker computes it (shortest first, earlier promises kept). A decode instance runs one continuous batch; between two
membership changes every step costs the same formula, so a whole stretch of
steps is one closed-form sum and one event, not one event per token.
"""

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from math import ceil, sqrt

from libs.common.prefill_order import Work, contended, plan, step_tokens
from libs.engine.cost_model import CostModel
from libs.protocol.ids import InstanceId, RequestId
from libs.protocol.schema import DecodeBeat, Heartbeat, PrefillBeat, StoreBeat
from libs.protocol.vocabulary import KVTier, Role
from services.conductor.routers import Decision
from services.conductor.simulator.trace import TraceRequest


@dataclass(eq=False)
class SimRequest:
    trace: TraceRequest
    request_id: RequestId
    decision: Decision | None = None
    outcome: str = "pending"  # rejected, wasted (prefilled, then refused by its decode instance), done
    reason: str | None = None
    prefill_start: float | None = None
    first_token: float | None = None
    finish: float | None = None
    cached_tokens: dict[str, int] = field(default_factory=dict)  # measured reuse, by tier
    prefill_seconds: float = 0.0  # busy time its prefill took (wasted when refused afterwards)
    best_effort: bool = False  # sent without an SLO
    remaining: int = 0  # decode steps left
    context: int = 0  # tokens of KV it holds while decoding

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.trace.arrival_s

    @property
    def tbt(self) -> float | None:
        """Mean time between its tokens after the first (waits in the decode queue included)."""
        if self.finish is None or self.first_token is None or self.trace.output_length < 2:
            return None
        return (self.finish - self.first_token) / (self.trace.output_length - 1)


class BlockLRU:
    """A cache of block ids with a capacity and least-recently-used eviction."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[Hashable, None] = OrderedDict()

    def prefix(self, blocks: Sequence[Hashable], start: int = 0) -> int:
        """How many of ``blocks[start:]`` in a row it holds."""
        n = start
        while n < len(blocks) and blocks[n] in self.blocks:
            n += 1
        return n - start

    def insert(self, blocks: Sequence[Hashable]) -> tuple[list[Hashable], list[Hashable]]:
        """Hold ``blocks`` (most recently used last); return (new blocks, evicted blocks)."""
        new, evicted = [], []
        for block in blocks:
            if block in self.blocks:
                self.blocks.move_to_end(block)
            else:
                self.blocks[block] = None
                new.append(block)
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        return new, evicted


class SimStore:
    def __init__(self, instance_id: InstanceId, capacity_blocks: int, cost: CostModel, reported: CostModel | None = None) -> None:
        self.instance_id = instance_id
        self.cache = BlockLRU(capacity_blocks)
        self.cost = cost
        self.reported = reported or cost  # the cost model its heartbeats give the conductor

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(instance_id=self.instance_id, role=Role.STORE, host_id="sim", payload=StoreBeat(
            cost=self.reported.coefficients, capacity=self.cache.capacity,
            free_blocks=self.cache.capacity - len(self.cache.blocks)))  # fmt: skip


class SimPrefill:
    """Serves its jobs as a prefill worker does (`libs/common/prefill_order.py`): each
    chunk of at most ``chunk_tokens`` goes to the head of the plan (shortest first,
    earlier promises kept, late ones next, best effort last), so a job is cut only
    between chunks; a chunk of a job not favored is at most ``contended_tokens`` while a
    favored job came in the last ``CONTENDED_S`` (0: never)."""

    def __init__(self, sim, instance_id: InstanceId, cost: CostModel, cache_blocks: int, chunk_tokens: int = 2048,
                 contended_tokens: int = 0) -> None:  # fmt: skip
        self.sim = sim
        self.instance_id = instance_id
        self.cost = cost
        self.cache = BlockLRU(cache_blocks)
        self.chunk_tokens = chunk_tokens
        self.contended_tokens = contended_tokens
        self.favored_at: float | None = None  # when a favored request last came
        self.queue: deque[SimRequest] = deque()  # submitted, not yet started
        self.jobs: dict[str, list] = {}  # request id -> [request, seconds left, deadline]
        self.running: SimRequest | None = None  # the chunk in progress is this request's
        self.busy_seconds = 0.0
        self.speeds: deque[float] = deque(maxlen=64)  # measured / reported, per job
        self._idle_beat: Heartbeat | None = None  # sent again while it has no job and its cache has not changed

    def submit(self, request: SimRequest) -> None:
        if request.decision is not None and request.decision.favored:
            self.favored_at = self.sim.now
        self.queue.append(request)
        self._start(request)
        if self.running is None:
            self._next_chunk()

    def _start(self, request: SimRequest) -> None:
        """Its prefix from this cache, the store, a peer; its duration from the cost model."""
        self.queue.remove(request)
        self._idle_beat = None
        sim, t = self.sim, request.trace
        bs = self.cost.block_size
        usable = min(len(t.hash_ids), (t.input_length - 1) // bs)
        blocks = t.hash_ids[:usable]
        local = self.cache.prefix(blocks)
        cached = {KVTier.DEVICE: local * bs} if local else {}
        reached, load_s = local, 0.0
        from_store = sim.store.cache.prefix(blocks, reached) if sim.store is not None else 0
        if from_store:
            load_s += from_store * sim.store.cost.load_time_per_block(KVTier.DRAM)
            cached[KVTier.DRAM] = from_store * bs
            reached += from_store
        peer_id = request.decision.copy_from if request.decision is not None else None
        if peer_id is not None and (peer := sim.prefills.get(peer_id)) is not None:
            copied = peer.cache.prefix(blocks, reached)
            if copied:
                load_s += self.cost.transfer_time(copied)
                cached[KVTier.PEER] = copied * bs
                reached += copied
        n_cached = reached * bs
        compute = self.cost.prefill_time(t.input_length - n_cached, n_cached)
        handoff = self.cost.transfer_time(ceil(t.input_length / bs))
        duration = (load_s + compute + handoff) * sim.noise()
        reported = CostModel(sim.reported)
        model = (load_s + reported.prefill_time(t.input_length - n_cached, n_cached)
                 + reported.transfer_time(ceil(t.input_length / bs)))  # fmt: skip
        if model > 0:
            self.speeds.append(duration / model)
        request.cached_tokens, request.prefill_seconds = cached, duration
        deadline = None if request.best_effort else t.arrival_s + sim.config.slo.ttft_s
        self.jobs[request.request_id] = [request, duration, deadline]
        self.busy_seconds += duration

    def _next_chunk(self) -> None:
        if not self.jobs:
            self.running = None
            return
        sim = self.sim
        order = plan((Work(k, left, deadline, r.trace.arrival_s, r.decision is not None and r.decision.favored)
                      for k, (r, left, deadline) in self.jobs.items()), sim.now)  # fmt: skip
        job = self.jobs[order[0].key]
        request = self.running = job[0]
        if request.prefill_start is None:
            request.prefill_start = sim.now
        step = min(job[1], self.cost.prefill_time(self._chunk_tokens(order[0].favored)))
        job[1] -= step
        sim.schedule(sim.now + step, self._chunk_done, request)

    def _chunk_tokens(self, favored: bool = False) -> int:
        """A chunk's most tokens: `prefill_order.step`'s rule, one job a chunk."""
        return step_tokens(self.chunk_tokens, self.contended_tokens, contended(self.favored_at, self.sim.now), favored)

    def _chunk_done(self, request: SimRequest) -> None:
        job = self.jobs[request.request_id]
        if job[1] <= 1e-12:
            del self.jobs[request.request_id]
            self._finish(request)
        self._next_chunk()

    def _finish(self, request: SimRequest) -> None:
        sim, t = self.sim, request.trace
        full = t.hash_ids[: min(len(t.hash_ids), t.input_length // self.cost.block_size)]
        new, evicted = self.cache.insert(full)
        self._idle_beat = None
        sim.index.discard(self.instance_id, KVTier.DEVICE, evicted)
        sim.index.add(self.instance_id, KVTier.DEVICE, new)
        if sim.store is not None:  # every new full block is written back to the store
            new, evicted = sim.store.cache.insert(full)
            sim.index.discard(sim.store.instance_id, KVTier.DRAM, evicted)
            sim.index.add(sim.store.instance_id, KVTier.DRAM, new)
        sim.prefilled(request)

    def heartbeat(self) -> Heartbeat:
        if self._idle_beat is not None and not self.jobs:
            return self._idle_beat
        queued = [job[0] for job in self.jobs.values()]
        speeds = sorted(self.speeds)
        beat = Heartbeat(instance_id=self.instance_id, role=Role.PREFILL, host_id="sim", payload=PrefillBeat(
            cost=self.sim.reported, load=len(queued), queued_tokens=sum(r.trace.input_length for r in queued),
            capacity=self.cache.capacity, free_blocks=self.cache.capacity - len(self.cache.blocks),
            speed=speeds[len(speeds) // 2] if speeds else 0.0, chunk_tokens=self._chunk_tokens(),
            progress={k: left / r.prefill_seconds if r.prefill_seconds > 0 else 0.0
                      for k, (r, left, _) in self.jobs.items()}))  # fmt: skip
        self._idle_beat = None if self.jobs else beat
        return beat


class SimDecode:
    """One continuous batch. Members join and leave only at step boundaries; an
    epoch is the stretch of steps between two such changes, whose ``k`` steps take
    T(k) = k·(d + e·B + f·C) + f·B·k(k-1)/2 (every step adds B tokens of context).
    A prompt it prefills itself is computed a chunk of at most ``chunk_tokens`` at a
    time between two decode steps (back to back while nothing decodes), first come
    first served; None: all of it at once."""

    def __init__(self, sim, instance_id: InstanceId, cost: CostModel, max_batch: int, kv_tokens: int,
                 chunk_tokens: int | None = None) -> None:  # fmt: skip
        self.sim = sim
        self.instance_id = instance_id
        self.cost = cost
        self.chunk_tokens = chunk_tokens
        self.chunk_s = None if chunk_tokens is None else cost.prefill_time(chunk_tokens)
        self.max_batch = max_batch
        self.kv_tokens = kv_tokens
        self.members: list[SimRequest] = []
        self.joining: list[SimRequest] = []  # handed over: joins at the next boundary
        self.waiting: deque[SimRequest] = deque()  # no room yet
        self.local_jobs: list[tuple[SimRequest, float]] = []  # conditional disaggregation: (request, seconds left)
        self.epoch_start = 0.0
        self.context = 0  # C: tokens of KV the members hold at the epoch start
        self.version = 0  # the boundary event that is current
        self.next_steps: int | None = None  # steps to that boundary
        self._idle_beat: Heartbeat | None = None  # sent again whenever it holds nothing: it never changes

    @property
    def num_sequences(self) -> int:
        return len(self.members) + len(self.joining) + len(self.waiting) + len(self.local_jobs)

    def _elapsed(self, k: int) -> float:
        c, b = self.cost.coefficients, len(self.members)
        return k * (c.decode_base + c.decode_per_seq * b + c.decode_per_context_token * self.context) + (
            c.decode_per_context_token * b * k * (k - 1) / 2
        )

    def _steps_until(self, dt: float) -> int:
        """The fewest steps of this epoch that take at least ``dt`` seconds."""
        if dt <= 0:
            return 0
        c, b = self.cost.coefficients, len(self.members)
        alpha = c.decode_base + c.decode_per_seq * b + c.decode_per_context_token * self.context
        beta = c.decode_per_context_token * b
        if beta > 0:
            k = ceil((-(alpha - beta / 2) + sqrt((alpha - beta / 2) ** 2 + 2 * beta * dt)) / beta - 1e-9)
        else:
            k = ceil(dt / alpha - 1e-9)
        while k > 0 and self._elapsed(k - 1) >= dt:
            k -= 1
        while self._elapsed(k) < dt:
            k += 1
        return k

    # --- arrivals ------------------------------------------------------------------
    def would_refuse(self, request: SimRequest, tbt_limit: float) -> bool:
        """Mooncake's decode-side check at hand-off: refuse what would push the batch
        past the TBT target (or that has no room at once)."""
        size = self.num_sequences + 1
        context = self._context_now() + sum(r.context for r in (*self.joining, *self.waiting)) + request.context
        alone = self.cost.decode_step_time(1, request.context)
        if self.cost.decode_step_time(size, context) > max(tbt_limit, alone):
            return True
        return size > self.max_batch or context > self.kv_tokens

    def _context_now(self) -> int:
        """The members' KV now: at the epoch start, plus a token each per step since."""
        dt = self.sim.now - self.epoch_start
        steps = self._steps_until(dt)
        if steps and self._elapsed(steps) > dt:
            steps -= 1  # that step is still running
        return self.context + steps * len(self.members)

    def hand_over(self, request: SimRequest) -> None:
        self.joining.append(request)
        self._wake()

    def prefill_locally(self, request: SimRequest) -> None:
        t = request.trace
        seconds = self.cost.prefill_time(t.input_length) * self.sim.noise()
        request.prefill_start, request.prefill_seconds = self.sim.now, seconds
        self.local_jobs.append((request, seconds))
        self._wake()

    def _wake(self) -> None:
        now = self.sim.now
        if not self.members and self.next_steps is None:
            self._advance(0)
            return
        k = self._steps_until(now - self.epoch_start)
        if self.next_steps is None or k < self.next_steps:
            self._schedule(k)

    # --- boundaries ----------------------------------------------------------------
    def _schedule(self, steps: int) -> None:
        self.version += 1
        self.next_steps = steps
        self.sim.schedule(self.epoch_start + self._elapsed(steps), self._boundary, self.version, steps)

    def _boundary(self, version: int, steps: int) -> None:
        if version == self.version:
            self._advance(steps)

    def _advance(self, steps: int) -> None:
        sim, now = self.sim, self.sim.now
        if steps:
            still = []
            for member in self.members:
                member.remaining -= steps
                member.context += steps
                if member.remaining <= 0:
                    sim.finished(member)
                else:
                    still.append(member)
            self.members = still
        start = now
        if self.local_jobs:  # the batch stalls while it prefills: one chunk (or one whole prompt) a boundary
            request, left = self.local_jobs[0]
            step = left if self.chunk_s is None else min(left, self.chunk_s)
            start += step
            if step >= left:
                self.local_jobs.pop(0)
                if sim.prefilled_locally(request, start):
                    self.joining.append(request)
            else:
                self.local_jobs[0] = (request, left - step)
        self.waiting.extend(self.joining)
        self.joining = []
        context = sum(m.context for m in self.members)
        while self.waiting and len(self.members) < self.max_batch and context + self.waiting[0].context <= self.kv_tokens:
            joiner = self.waiting.popleft()
            self.members.append(joiner)
            context += joiner.context
        self.epoch_start, self.context = start, context
        if self.members:  # with local prefills left, the next chunk comes after one decode step
            self._schedule(1 if self.local_jobs else min(m.remaining for m in self.members))
        elif self.local_jobs:
            self._schedule(0)  # nothing decodes: the next chunk at once
        else:
            self.version += 1
            self.next_steps = None

    def heartbeat(self) -> Heartbeat:
        idle = not (self.members or self.joining or self.waiting or self.local_jobs)
        if idle and self._idle_beat is not None:
            return self._idle_beat
        bs = self.cost.block_size
        beat = Heartbeat(instance_id=self.instance_id, role=Role.DECODE, host_id="sim", payload=DecodeBeat(
            cost=self.sim.reported, load=self.num_sequences, batch_size=len(self.members),
            chunk_tokens=self.chunk_tokens or 0,
            context_tokens=self._context_now(), capacity=self.kv_tokens // bs,
            free_blocks=max(0, self.kv_tokens - self.context) // bs))  # fmt: skip
        if idle:
            self._idle_beat = beat
        return beat
