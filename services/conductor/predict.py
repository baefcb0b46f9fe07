"""Predictions for one admission: the TTFT a request would see on each prefill
instance and the TBT it would see on each decode instance.

TTFT on a prefill instance = its queue + loading the prompt's blocks it lacks
but a store holds (or, with replication, copying them from a peer's cache) +
computing the rest + handing the KV to the decode worker; every term comes from
that instance's own measured cost model. TBT on a decode instance = its mean
step time over this request's expected life in the batch it is predicted to run
(every member's context grows by a token a step). Admission multiplies both by
the margins learned from their observed error (`margin.py`). A request the decode
instance prefills itself (conditional disaggregation, or a colocated cluster with
no prefill instance) stalls that instance's batch for its prefill and for the
local prefills queued ahead of it: that stall is spread over a member's expected
tokens and added to the TBT (`with_prefill_stall`). Pure functions of
the cluster view, the index match and the clock.
"""

from dataclasses import dataclass, replace
from math import ceil
from typing import TYPE_CHECKING

from libs.protocol.ids import InstanceId
from libs.protocol.schema import AdmitRequest
from libs.protocol.slo import SLO
from libs.protocol.vocabulary import KVTier, Role
from services.conductor.cluster import ClusterView, Instance
from services.conductor.index import PrefixMatch
from services.conductor.margin import Margins

if TYPE_CHECKING:
    from services.conductor.candidates import Candidates


@dataclass(frozen=True)
class PredictConfig:
    block_size: int = 16  # tokens per hashed block, as the gateway hashes them
    balancing_threshold: float = 2.0  # copy a peer's prefix only when it is this many times ours
    expected_output_tokens: int = 512  # decode length assumed when max_tokens is larger


@dataclass(frozen=True)
class PrefillEstimate:
    instance_id: InstanceId
    queue_s: float
    load_s: float  # store loads and peer copies
    compute_s: float
    handoff_s: float
    cached_tokens: dict[KVTier, int]  # tokens reused, by tier they come from (PEER: copied from another instance)
    copy_from: str | None = None  # replication: the peer whose cache it copies
    copy_blocks: int = 0
    speed: float = 1.0  # the instance's learned slowness, already applied to load, compute and hand-off
    interleave_s: float = 0.0  # a decode instance's own prefill: the decode steps it runs between the chunks

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.load_s + self.compute_s + self.handoff_s + self.interleave_s

    @property
    def unloaded_ttft_s(self) -> float:
        """The TTFT with an empty queue: what the request costs by itself."""
        return self.ttft_s - self.queue_s

    @property
    def work_s(self) -> float:
        """What it adds to the instance's queue."""
        return self.load_s + self.compute_s + self.handoff_s + self.interleave_s


@dataclass(frozen=True)
class DecodeEstimate:
    instance_id: InstanceId
    tbt_s: float  # step time with this request in the batch predicted for it
    batch_size: int  # that batch, this request included
    fits: bool = True  # its KV fits the instance's pool beside that batch's


def step_now(d: Instance) -> float:
    """``d``'s step time now (at least one sequence), from its prompts and heartbeat."""
    hb, load = d.heartbeat, d.decode
    count = max(load.num_decoding, hb.batch_size, 1)
    return d.cost.decode_step_time(count, max(load.decoding_prompt_tokens, hb.context_tokens))


def modelled_step(d: Instance, now: float) -> float:
    """The step time the cost model gives ``d``'s batch now, generated tokens included."""
    count, context = d.decode.current(now, step_now(d))
    hb = d.heartbeat
    return d.cost.decode_step_time(max(count, hb.batch_size, 1), max(context, hb.context_tokens))


class AdmitContext:
    """Everything a policy looks at for one request, and the predictions built on it.

    Routers call `prefill_ttft` / `decode_tbt` on every candidate (plain floats,
    cheap) and the `*_estimate` methods, which give the same numbers with their
    parts, only for the instances they pick. Each instance's prediction is computed
    once per decision and reused by every later look at it (router, affinity,
    admission, explanation): nothing is booked until the decision is made.
    """

    def __init__(self, request: AdmitRequest, match: PrefixMatch, view: ClusterView, now: float, slo: SLO,
                 config: PredictConfig, prefills: list[Instance] | None = None, decodes: list[Instance] | None = None,
                 stores: list[Instance] | None = None, margins: Margins | None = None,
                 shorter_share: float = 0.0, candidates: "Candidates | None" = None,
                 excluded: frozenset[str] = frozenset(), favored: bool = False,
                 replication: bool = False) -> None:  # fmt: skip
        self.request, self.match, self.view, self.now, self.slo, self.config = request, match, view, now, slo, config
        self.candidates = candidates  # None: routers look at every instance
        self.excluded = excluded  # left out of ``prefills`` and ``decodes`` (the gateway saw them die)
        self.favored = favored  # its prefill goes before the other jobs of its kind (fair_share.py)
        self.replication = replication  # a prefill instance may copy a longer prefix from a peer (routers.py)
        self.margins = margins or Margins()
        self.shorter_share = shorter_share  # the share of a prefill instance shorter prompts take (overload.py)
        self.prefills, self.decodes, self.stores = prefills or [], decodes or [], stores or []
        self.num_tokens = request.num_prompt_tokens
        self.num_sequences = max(1, request.num_sequences)  # n: one prefill, n members of the decode batch
        bs = config.block_size
        # prompt blocks a cache can supply: the last token is always computed
        self.usable_blocks = min(match.num_blocks, (self.num_tokens - 1) // bs)
        self.handoff_blocks = ceil(self.num_tokens / bs)
        self.expected_output_tokens = max(1, min(request.max_tokens, config.expected_output_tokens))
        # when its first token is due (None: best effort, which waits behind all SLO work), and so
        # when its prefill must be done: the slack learned for what happens outside it comes first
        self.deadline = None if request.best_effort else now + slo.ttft_s
        self.ttft_slack = self.margins.ttft(self.num_tokens)
        self.prefill_deadline = None if self.deadline is None else self.deadline - self.ttft_slack
        self._store = self._best_store()
        self._peer = self.best_peer() if replication else None  # the peer a prefix may be copied from
        self._parts: dict[str, tuple] = {}  # by prefill instance: `_prefill_parts`
        self._local: dict[str, PrefillEstimate] = {}  # by decode instance: `local_prefill_estimate`
        self._batch: dict[str, tuple] = {}  # by decode instance: `_batches`
        self._batch_all: dict[str, tuple[int, int]] = {}  # by decode instance: `batch_all`

    # --- candidates -------------------------------------------------------------------
    def instance(self, instance_id: InstanceId, role: str) -> Instance | None:
        """``instance_id`` if it is a live, not excluded instance of ``role``."""
        if self.candidates is None:
            pool = self.prefills if role == Role.PREFILL else self.decodes if role == Role.DECODE else self.stores
            return next((i for i in pool if i.instance_id == instance_id), None)
        instance = self.view.get(instance_id)
        if instance is None or instance.role != role or instance_id in self.excluded:
            return None
        return instance

    def prefill_candidates(self) -> list[Instance]:
        """The prefill instances among which the cheapest (`prefill_cost`) is found: every
        one, or, pruned (`candidates.py`), the busy, the best idle instance of each bucket
        and the best idle holder of each longer prefix of the prompt (with replication,
        of every prefix: a shorter one may copy more)."""
        if self.candidates is None:
            return self.prefills
        usable = self.usable_blocks
        groups = ((min(length, usable), ids) for length, ids in self.match.by_length())
        found = self.candidates.prefill.candidates(groups, lambda i: min(self.match.blocks(i), usable), self.excluded,
                                                   monotone=not self.replication)  # fmt: skip
        return found or self.prefills

    def decode_candidates(self) -> list[Instance]:
        """The decode instances among which the least TBT (`decode_tbt`) is found: every
        one, or, pruned, the busy and the best idle."""
        if self.candidates is None:
            return self.decodes
        return self.candidates.decode.candidates(skip=self.excluded) or self.decodes

    # --- TTFT -------------------------------------------------------------------------
    def _prefill_parts(self, p: Instance) -> tuple:
        """(queue, load, compute, handoff, local blocks, store blocks, copy_from, copy blocks, speed) on ``p``."""
        parts = self._parts.get(p.instance_id)
        if parts is None:
            parts = self._parts[p.instance_id] = self._compute_prefill_parts(p)
        return parts

    def _compute_prefill_parts(self, p: Instance) -> tuple:
        c = p.cost.coefficients
        local = self.match.blocks(p.instance_id)
        if local > self.usable_blocks:
            local = self.usable_blocks
        reached, load = local, 0.0
        store_len, _, counts, store_cost = self._store
        if store_len > local:
            cost = store_cost or p.cost
            for tier, running in counts.items():
                load += (running[store_len] - running[local]) * cost.load_time_per_block(tier)
            reached = store_len
        copy_from, copy_blocks = None, 0
        if self._peer is not None:
            peer_len, peer_id = self._peer
            if peer_len > reached and peer_id != p.instance_id and peer_len >= self.config.balancing_threshold * max(local, 1):
                copy_from, copy_blocks = peer_id, peer_len - reached
                load += copy_blocks * c.transfer_per_block
                reached = peer_len
        n_cached = reached * self.config.block_size
        n_new = self.num_tokens - n_cached
        compute = c.prefill_base + n_new * (c.prefill_per_token + c.prefill_per_token_context * (n_cached + n_new / 2))
        speed = self.prefill_speed(p)
        handoff = self.handoff_blocks * c.transfer_per_block
        work = (load + compute + handoff) * speed
        return (p.prefill.wait(work, self.now, self.prefill_deadline), load * speed, compute * speed, handoff * speed, local,
                max(store_len - local, 0), copy_from, copy_blocks, speed)  # fmt: skip

    def prefill_speed(self, p: Instance) -> float:
        """How much slower than its cost model ``p`` runs: what it measured of its own
        steps (its heartbeat), else what its reported prefills showed."""
        measured = p.heartbeat.prefill_speed
        return measured if measured > 0 else self.margins.prefill_speed(p.instance_id)

    def prefill_ttft(self, p: Instance) -> float:
        queue, load, compute, handoff, *_ = self._prefill_parts(p)
        return queue + load + compute + handoff

    def prefill_cost(self, p: Instance) -> float:
        """What routing the request to ``p`` costs: its own TTFT there, plus the delay it
        adds to the longer requests it would go ahead of (a prefill instance computes
        the shortest work first)."""
        queue, load, compute, handoff, *_ = self._prefill_parts(p)
        work = load + compute + handoff
        imposed = 0.0 if self.prefill_deadline is None else p.prefill.imposed(work, self.now)
        return queue + work + imposed

    def prefill_estimate(self, p: Instance) -> PrefillEstimate:
        queue, load, compute, handoff, local, from_store, copy_from, copy_blocks, speed = self._prefill_parts(p)
        bs = self.config.block_size
        cached = {KVTier.DEVICE: local * bs} if local else {}
        if from_store:
            store_len, _, counts, _ = self._store
            for tier, running in counts.items():
                if n := running[store_len] - running[local]:
                    cached[tier] = n * bs
        if copy_blocks:
            cached[KVTier.PEER] = copy_blocks * bs
        return PrefillEstimate(p.instance_id, queue, load, compute, handoff, cached, copy_from, copy_blocks, speed)

    def local_prefill_estimate(self, d: Instance) -> PrefillEstimate:
        """Prefilling on decode instance ``d`` itself: no cache, no hand-off; its queue is
        the local prefills booked on ``d`` before it. Beside a decoding batch ``d``
        computes a chunk between two decode steps, so each chunk after the first waits one."""
        if (known := self._local.get(d.instance_id)) is not None:
            return known
        speed = self.margins.prefill_speed(d.instance_id)
        compute = d.cost.prefill_time(self.num_tokens) * speed
        interleave = 0.0
        chunk_s = d.prefill.chunk_s
        if chunk_s and compute > chunk_s and (d.decode.num_decoding or d.heartbeat.batch_size):
            interleave = (ceil(compute / chunk_s) - 1) * step_now(d)
        estimate = PrefillEstimate(d.instance_id, d.prefill.backlog(self.now), 0.0, compute, 0.0, {}, speed=speed,
                                   interleave_s=interleave)  # fmt: skip
        self._local[d.instance_id] = estimate
        return estimate

    def with_prefill_stall(self, tbt: DecodeEstimate, stall_s: float) -> DecodeEstimate:
        """``tbt`` with ``stall_s`` seconds of prefill run on its decode instance: a prefill
        there runs between two decode steps and holds up the whole batch, so each member's
        mean time between tokens grows by the stall spread over its expected tokens."""
        return replace(tbt, tbt_s=tbt.tbt_s + stall_s / self.expected_output_tokens)

    def stall_room(self, d: Instance) -> float:
        """Seconds of prefill ``d`` may still run between its decode steps before one of
        the requests already booked on it (decoding or on its way) is predicted to miss
        its TBT target, at the step time of that batch with this request in it."""
        limit = self.slo.tbt_s / self.margins.tbt(d.instance_id)
        return d.decode.stall_room(self.decode_all(d).tbt_s, limit)

    def best_peer(self) -> tuple[int, str] | None:
        """(blocks, instance) of the prefill instance holding the longest prefix."""
        usable, best = self.usable_blocks, None
        for length, ids in self.match.by_length():  # longest first; ties go to the smallest id
            n = min(length, usable)
            if n <= 0 or (best is not None and n < best[0]):
                break
            for i in ids:
                if self.instance(i, Role.PREFILL) is not None and (best is None or i < best[1]):
                    best = (n, i)
        return best

    def _best_store(self) -> tuple[int, str | None, dict[str, list[int]], object]:
        """The store holding the longest prefix: (blocks, id, per-tier running counts, its cost model)."""
        best_len, best = 0, None
        for s in self.stores:
            n = min(self.match.blocks(s.instance_id), self.usable_blocks)
            if n > best_len:
                best_len, best = n, s
        counts: dict[str, list[int]] = {}
        if best is not None:
            for i, tier in enumerate(self.match.tiers(best.instance_id, 0, best_len)):
                running = counts.setdefault(tier, [0] * (best_len + 1))
                running[i + 1] = 1
            for running in counts.values():
                for i in range(1, best_len + 1):
                    running[i] += running[i - 1]
        cost = best.cost if best is not None and best.heartbeat.cost is not None else None
        return best_len, best.instance_id if best else None, counts, cost

    # --- TBT --------------------------------------------------------------------------
    def step_now(self, d: Instance) -> float:
        return step_now(d)

    def _batches(self, d: Instance) -> tuple[float, tuple[int, int], tuple[int, int]]:
        """(step time now, the batch by the records, the batch now: the records or the
        heartbeat where it says more; each as (sequences, context tokens))."""
        if (known := self._batch.get(d.instance_id)) is not None:
            return known
        self._batch[d.instance_id] = batches = self._compute_batches(d)
        return batches

    def _compute_batches(self, d: Instance) -> tuple[float, tuple[int, int], tuple[int, int]]:
        step = self.step_now(d)
        recorded = d.decode.current(self.now, step)
        hb = d.heartbeat
        return step, recorded, (max(recorded[0], hb.batch_size), max(recorded[1], hb.context_tokens))

    def batch_now(self, d: Instance) -> tuple[int, int]:
        return self._batches(d)[2]

    def batch_all(self, d: Instance) -> tuple[int, int]:
        """The batch now plus every request on its way to it (in prefill)."""
        if (known := self._batch_all.get(d.instance_id)) is not None:
            return known
        _, _, now = self._batches(d)
        coming = d.decode.coming()
        batch = self._batch_all[d.instance_id] = (now[0] + coming[0], now[1] + coming[1])
        return batch

    def added_context(self) -> int:
        """The context this request adds to a batch when it joins: each of its sequences
        attends to the prompt and its first token (the prompt's KV is shared, so this
        overstates its memory when n > 1)."""
        return (self.num_tokens + 1) * self.num_sequences

    def decode_estimate(self, d: Instance, batch: tuple[int, int]) -> DecodeEstimate:
        """This request's mean step time in ``batch`` (plus itself): over its expected
        life every member's context grows by one token a step, half of it on average."""
        size, context = batch[0] + self.num_sequences, batch[1] + self.added_context()
        capacity = d.heartbeat.capacity * self.config.block_size  # 0: not reported
        fits = not capacity or context <= capacity
        mean_context = context + size * self.expected_output_tokens // 2
        return DecodeEstimate(d.instance_id, d.cost.decode_step_time(size, mean_context), size, fits)

    def decode_tbt(self, d: Instance) -> float:
        """`decode_all`'s TBT alone, times the speed ``d``'s measured TBTs show (for comparing
        candidates: workers calibrated side by side on a busy machine can each be measured
        far from how they then run, and would otherwise draw every request to one)."""
        count, context = self.batch_all(d)
        step = d.cost.decode_step_time(count + self.num_sequences, context + self.added_context())
        return step * self.margins.decode_speed(d.instance_id)

    def least_tbt(self, decodes: list[Instance]) -> Instance:
        """The instance of ``decodes`` with the least `decode_tbt` (ties: the smallest id),
        reading the batches of only those that a lower bound does not rule out.

        The bound is the batch's step time without the tokens generated since its
        requests started (the records' prompts, the heartbeat's and those on their way
        are known without reading the clock), times the same speed: a step costs no
        less for more sequences or context (non-negative coefficients), so no instance
        whose bound exceeds the least TBT found can be the one. Where most instances
        are idle, the best idle one's TBT rules out nearly every busy one."""
        n, added = self.num_sequences, self.added_context()
        speed = self.margins.decode_speeds()
        floors = []
        for d in decodes:
            hb = d.heartbeat
            count, context = d.decode.at_least(hb.batch_size, hb.context_tokens)
            instance_id = hb.instance_id
            floors.append((d.cost.decode_step_time(count + n, context + added) * speed(instance_id), instance_id, d))
        floors.sort()  # by bound, then id (ids are unique: instances are never compared)
        best: tuple[float, str] | None = None
        chosen = decodes[0]
        for floor, instance_id, d in floors:
            if best is not None and floor > best[0]:
                break  # this one and every later one: a TBT above the least found
            key = (self.decode_tbt(d), instance_id)
            if best is None or key < best:
                best, chosen = key, d
        return chosen

    def decode_now(self, d: Instance) -> DecodeEstimate:
        """Against the batch decoding now (what plain early rejection sees)."""
        return self.decode_estimate(d, self.batch_now(d))

    def decode_all(self, d: Instance) -> DecodeEstimate:
        """Against the batch now plus every request on its way to it."""
        return self.decode_estimate(d, self.batch_all(d))

    def decode_at(self, d: Instance, at: float) -> DecodeEstimate:
        """Against the batch predicted for the moment ``at`` (prediction-based rejection):
        the batch now, plus the requests predicted to land by then, minus those
        predicted to finish by then (decoding at the step time the instance has now,
        times the speed learned from its measured TBTs)."""
        step, recorded, now = self._batches(d)
        count, context = d.decode.forecast(at, self.now, step * self.margins.decode_speed(d.instance_id))
        return self.decode_estimate(d, (count + now[0] - recorded[0], context + now[1] - recorded[1]))

    def decode_duration(self, d: Instance) -> float:
        """How long this request is predicted to decode on ``d``."""
        return self.expected_output_tokens * self.decode_all(d).tbt_s
