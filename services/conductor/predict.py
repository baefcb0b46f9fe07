"""Predictions for one admission: the TTFT a request would see on each prefill
instance and the TBT it would see on each decode instance.

TTFT on a prefill instance = its queue + loading the prompt's blocks it lacks
but a store holds (or, with replication, copying them from a peer's cache) +
computing the rest + handing the KV to the decode worker; every term comes from
that instance's own measured cost model. TBT on a decode instance = its step
time with this request added to the batch it is predicted to run. Pure
functions of the cluster view, the index match and the clock.
"""

from dataclasses import dataclass, field
from math import ceil

from libs.common.schema import AdmitRequest
from services.conductor.cluster import ClusterView, Instance
from services.conductor.index import PrefixMatch


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tbt_s: float


@dataclass(frozen=True)
class PredictConfig:
    block_size: int = 16  # tokens per hashed block, as the gateway hashes them
    balancing_threshold: float = 2.0  # copy a peer's prefix only when it is this many times ours
    expected_output_tokens: int = 512  # decode length assumed when max_tokens is larger


@dataclass(frozen=True)
class PrefillEstimate:
    instance_id: str
    queue_s: float
    load_s: float  # store loads and peer copies
    compute_s: float
    handoff_s: float
    cached_tokens: dict[str, int]  # tokens reused, by tier they come from ("peer": copied from another instance)
    copy_from: str | None = None  # replication: the peer whose cache it copies
    copy_blocks: int = 0

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.load_s + self.compute_s + self.handoff_s

    @property
    def unloaded_ttft_s(self) -> float:
        """The TTFT with an empty queue: what the request costs by itself."""
        return self.ttft_s - self.queue_s

    @property
    def work_s(self) -> float:
        """What it adds to the instance's queue."""
        return self.load_s + self.compute_s + self.handoff_s


@dataclass(frozen=True)
class DecodeEstimate:
    instance_id: str
    tbt_s: float  # step time with this request in the batch predicted for it
    batch_size: int  # that batch, this request included
    fits: bool = True  # its KV fits the instance's pool beside that batch's


@dataclass
class AdmitContext:
    """Everything a policy looks at for one request."""

    request: AdmitRequest
    match: PrefixMatch
    view: ClusterView
    now: float
    slo: SLO
    config: PredictConfig
    prefills: list[Instance] = field(default_factory=list)
    decodes: list[Instance] = field(default_factory=list)
    stores: list[Instance] = field(default_factory=list)
    _store: tuple | None = None

    @property
    def num_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def usable_blocks(self) -> int:
        """Prompt blocks a cache can supply: the last token is always computed."""
        return min(self.match.num_blocks, (self.num_tokens - 1) // self.config.block_size)

    @property
    def expected_output_tokens(self) -> int:
        return max(1, min(self.request.max_tokens, self.config.expected_output_tokens))

    # --- TTFT -------------------------------------------------------------------------
    def prefill_estimate(self, p: Instance, replication: bool = False, best_peer: tuple[int, str] | None = None) -> PrefillEstimate:
        bs, usable = self.config.block_size, self.usable_blocks
        local = min(self.match.blocks(p.instance_id), usable)
        cached = {"device": local * bs} if local else {}
        reached, load_s = local, 0.0
        store_len, store_id, tier_counts, store_cost = self._best_store()
        if store_len > local:
            for tier, counts in tier_counts.items():
                n = counts[store_len] - counts[local]
                if n:
                    load_s += n * (store_cost or p.cost).load_time_per_block(tier)
                    cached[tier] = n * bs
            reached = store_len
        copy_from, copy_blocks = None, 0
        if replication and best_peer is not None:
            peer_len, peer_id = best_peer
            if peer_id != p.instance_id and peer_len > reached and peer_len >= self.config.balancing_threshold * max(local, 1):
                copy_from, copy_blocks = peer_id, peer_len - reached
                load_s += p.cost.transfer_time(copy_blocks)
                cached["peer"] = copy_blocks * bs
                reached = peer_len
        n_cached = reached * bs
        return PrefillEstimate(
            instance_id=p.instance_id,
            queue_s=p.prefill.backlog(self.now),
            load_s=load_s,
            compute_s=p.cost.prefill_time(self.num_tokens - n_cached, n_cached),
            handoff_s=p.cost.transfer_time(ceil(self.num_tokens / bs)),
            cached_tokens=cached,
            copy_from=copy_from,
            copy_blocks=copy_blocks,
        )

    def local_prefill_estimate(self, d: Instance) -> PrefillEstimate:
        """Prefilling on decode instance ``d`` itself: no cache, no hand-off."""
        return PrefillEstimate(d.instance_id, d.prefill.backlog(self.now), 0.0, d.cost.prefill_time(self.num_tokens), 0.0, {})

    def best_peer(self) -> tuple[int, str] | None:
        """(blocks, instance) of the prefill instance holding the longest prefix."""
        usable, best = self.usable_blocks, None
        for p in self.prefills:  # by id: ties go to the smallest
            n = min(self.match.blocks(p.instance_id), usable)
            if n > 0 and (best is None or n > best[0]):
                best = (n, p.instance_id)
        return best

    def _best_store(self) -> tuple[int, str | None, dict[str, list[int]], object]:
        """The store holding the longest prefix: (blocks, id, per-tier running counts, its cost model)."""
        if self._store is None:
            usable = self.usable_blocks
            best_len, best = 0, None
            for s in self.stores:
                n = min(self.match.blocks(s.instance_id), usable)
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
            self._store = (best_len, best.instance_id if best else None, counts, cost)
        return self._store

    # --- TBT --------------------------------------------------------------------------
    def step_now(self, d: Instance) -> float:
        """``d``'s step time now (at least one sequence), from its prompts and heartbeat."""
        hb = d.heartbeat
        count = max(d.decode.num_decoding, hb.batch_size, 1)
        return d.cost.decode_step_time(count, max(d.decode.decoding_prompt_tokens, hb.context_tokens))

    def batch_now(self, d: Instance) -> tuple[int, int]:
        """(sequences, context tokens) decoding on ``d`` now: the conductor's records,
        or the heartbeat where it says more."""
        count, context = d.decode.current(self.now, self.step_now(d))
        hb = d.heartbeat
        return max(count, hb.batch_size), max(context, hb.context_tokens)

    def added_context(self) -> int:
        """The KV this request holds when it joins a batch."""
        return self.num_tokens + 1

    def decode_estimate(self, d: Instance, batch: tuple[int, int]) -> DecodeEstimate:
        size, context = batch[0] + 1, batch[1] + self.added_context()
        capacity = d.heartbeat.capacity * self.config.block_size  # 0: not reported
        fits = not capacity or context <= capacity
        return DecodeEstimate(d.instance_id, d.cost.decode_step_time(size, context), size, fits)

    def decode_now(self, d: Instance) -> DecodeEstimate:
        """Against the batch decoding now (what plain early rejection sees)."""
        return self.decode_estimate(d, self.batch_now(d))

    def decode_all(self, d: Instance) -> DecodeEstimate:
        """Against the batch now plus every request on its way to it."""
        step = self.step_now(d)
        count, context = d.decode.total(self.now, step)
        now_count, now_context = self.batch_now(d)
        recorded = d.decode.current(self.now, step)
        return self.decode_estimate(d, (count + now_count - recorded[0], context + now_context - recorded[1]))

    def decode_at(self, d: Instance, at: float) -> DecodeEstimate:
        """Against the batch predicted for the moment ``at`` (prediction-based rejection):
        the batch now, plus the requests predicted to land by then, minus those
        predicted to finish by then (decoding at the step time the instance has now)."""
        step = self.step_now(d)
        count, context = d.decode.forecast(at, self.now, step)
        recorded = d.decode.current(self.now, step)
        now_count, now_context = self.batch_now(d)  # what the heartbeat shows beyond the records stays
        return self.decode_estimate(d, (count + now_count - recorded[0], context + now_context - recorded[1]))

    def decode_duration(self, d: Instance) -> float:
        """How long this request is predicted to decode on ``d``."""
        return self.expected_output_tokens * self.decode_all(d).tbt_s
