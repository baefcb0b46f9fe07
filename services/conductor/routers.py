"""Routing policies: plain classes behind one interface, so the live conductor
and the simulator run the same code.

A router picks a (prefill, decode) pair and says what it predicts for it;
`admission.py` then decides whether to admit at all. ``KVSERVE_POLICY`` names a
router and, joined with ``+``, options: ``cache_aware+replication+predictive_rejection``.

- random:       any prefill, any decode (a seeded generator: reproducible).
- least_loaded: the fewest requests on each side.
- cache_aware:  Mooncake's Algorithm 1: the prefill instance with the least
                TTFT = queue + load of the cached blocks it lacks + prefill of
                the rest (plus, since an instance computes the shortest work
                first, the delay it adds to the longer requests queued there);
                the decode instance with the least predicted TBT. It looks only
                at the candidates that can win (`candidates.py`): the same
                choice as over every instance, at a cost that does not grow
                with the idle ones.
- +replication: a prefix much longer (``balancing_threshold`` times) in a peer's
                cache than in a candidate's may be copied to that candidate:
                a busy instance's hot prefix is replicated on an idle one.

With no prefill instance alive and ``+local_prefill`` (a colocated cluster, as
``kvserve up --prefill 0`` runs), each router picks only a decode instance, which
prefills the request itself (`route_local`).
"""

import random
from dataclasses import dataclass, field
from typing import Protocol

from libs.protocol.vocabulary import ErrorCode
from services.conductor.cluster import Instance
from services.conductor.predict import AdmitContext, DecodeEstimate, PrefillEstimate


@dataclass(frozen=True)
class Route:
    prefill: PrefillEstimate
    decode: DecodeEstimate

    @property
    def is_local(self) -> bool:
        """The decode instance prefills the request itself (its prefill stalls that batch)."""
        return self.prefill.instance_id == self.decode.instance_id


@dataclass(frozen=True)
class Decision:
    prefill_id: str | None = None
    decode_id: str | None = None
    prefill_on_decode: bool = False  # conditional disaggregation
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    best_effort: bool = False  # admitted, though predicted to miss an SLO even alone (nothing queued ahead)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    work_s: float = 0.0  # predicted seconds it adds to the prefill queue
    prefill_speed: float = 1.0  # the prefill instance's learned slowness, already in work_s and the TTFT
    copy_from: str | None = None  # replication: the peer whose prefix is copied
    copy_blocks: int = 0
    error_code: ErrorCode | None = None
    error_message: str | None = None
    reason: str | None = None  # rejected: ttft_slo or tbt_slo
    affinity: str | None = None  # a session's turn: whether it stayed where its last turn ran, and why
    retry_after_s: float | None = None
    prefill_deadline_s: float | None = None  # admitted: its prefill is due this long after admission; None: best effort
    favored: bool = False  # admitted: its prefill goes before the other jobs of its kind (fair_share.py)

    @property
    def admitted(self) -> bool:
        return self.error_code is None


class Router(Protocol):
    name: str
    replication: bool  # a prefill instance may copy a longer prefix from a peer (AdmitContext.replication)

    def route(self, ctx: AdmitContext) -> Route: ...

    def route_local(self, ctx: AdmitContext) -> Route:
        """A decode instance that prefills the request itself (no prefill instance is alive)."""
        ...


def missing_roles(prefills: list[Instance], decodes: list[Instance]) -> Decision | None:
    """The rejection to give when a role has no live instance, else None."""
    if not prefills and not decodes:
        return Decision(error_code=ErrorCode.NO_INSTANCES, error_message="no prefill and no decode instance is alive")
    if not prefills:
        return Decision(error_code=ErrorCode.NO_PREFILL, error_message="no prefill instance is alive")
    if not decodes:
        return Decision(error_code=ErrorCode.NO_DECODE, error_message="no decode instance is alive")
    return None


class RandomRouter:
    name = "random"
    replication = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def route(self, ctx: AdmitContext) -> Route:
        p = ctx.prefills[self.rng.randrange(len(ctx.prefills))]
        d = ctx.decodes[self.rng.randrange(len(ctx.decodes))]
        return Route(ctx.prefill_estimate(p), ctx.decode_all(d))

    def route_local(self, ctx: AdmitContext) -> Route:
        return local_route(ctx, ctx.decodes[self.rng.randrange(len(ctx.decodes))])


class LeastLoadedRouter:
    """The instance of each role with the fewest requests; ties go to the most free
    KV blocks, then to the smallest id (so choices are deterministic)."""

    name = "least_loaded"
    replication = False

    def route(self, ctx: AdmitContext) -> Route:
        p = min(ctx.prefills, key=_load_key)
        d = min(ctx.decodes, key=_load_key)
        return Route(ctx.prefill_estimate(p), ctx.decode_all(d))

    def route_local(self, ctx: AdmitContext) -> Route:
        return local_route(ctx, min(ctx.decodes, key=_load_key))


def _load_key(i: Instance) -> tuple:
    return i.load, -i.heartbeat.free_blocks, i.instance_id


class CacheAwareRouter:
    """Least predicted TTFT (ties: fewer requests, then id); least predicted TBT."""

    def __init__(self, replication: bool = False) -> None:
        self.replication = replication
        self.name = "cache_aware+replication" if replication else "cache_aware"

    def route(self, ctx: AdmitContext) -> Route:
        best, best_key = None, None
        for p in ctx.prefill_candidates():  # with replication (the context's), a peer's prefix may be copied
            key = (ctx.prefill_cost(p), p.load, p.instance_id)
            if best_key is None or key < best_key:
                best, best_key = p, key
        decode = ctx.least_tbt(ctx.decode_candidates())
        return Route(ctx.prefill_estimate(best), ctx.decode_all(decode))

    def route_local(self, ctx: AdmitContext) -> Route:
        """The least predicted TTFT (its local prefill queue and compute); ties: least TBT, then id."""
        d = min(ctx.decodes, key=lambda d: (ctx.local_prefill_estimate(d).ttft_s, ctx.decode_tbt(d), d.instance_id))
        return local_route(ctx, d)


def local_route(ctx: AdmitContext, d: Instance) -> Route:
    """Decode instance ``d`` prefilling the request itself: its batch (now and on its way)
    stalled by the local prefills queued on ``d`` and by this one."""
    p = ctx.local_prefill_estimate(d)
    return Route(p, ctx.with_prefill_stall(ctx.decode_all(d), p.queue_s + p.compute_s))


ROUTERS = ("random", "least_loaded", "cache_aware")
OPTIONS = ("replication", "early_rejection", "predictive_rejection", "local_prefill")


def build_router(name: str, replication: bool, rng: random.Random | None) -> Router:
    if name == "random":
        return RandomRouter(rng)
    if name == "least_loaded":
        return LeastLoadedRouter()
    if name == "cache_aware":
        return CacheAwareRouter(replication)
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
