"""Admission on top of routing: admit a request, or reject it at once because
its SLOs cannot be met now (Mooncake's early rejection), and conditional
disaggregation (prefill on the decode worker when that is predicted faster).

- early_rejection:      predicted TTFT over the TTFT SLO, or the TBT of the
                        batch decoding now (plus this request) over the TBT SLO.
                        (A batch whose KV would not fit the decode pool is
                        refused the same way, reason decode_full.)
- predictive_rejection: the same, but the TBT of the batch predicted for the
                        moment this request's prefill ends, requests now in
                        prefill included: plain early rejection sees decode load
                        only once it has landed and so admits in waves.
Both compare each prediction with the SLO after adding the TTFT slack, or
multiplying the TBT by the margin, learned from their observed errors
(`margin.py`). The TTFT is predicted where the request lands in
the prefill instance's order (shortest first, earlier promises kept:
`libs/common/prefill_order.py`), and a request whose admission would make an
admitted one miss its target is refused. A request that misses its TTFT target
even on an idle instance is refused at once as ``slo_unattainable`` (no
Retry-After: waiting would not help) unless it asked for best effort; with
nothing queued, one that can meet its targets is never refused. A moved request
(its worker was lost) is never refused.
A request its decode instance prefills itself is judged with the TBT that
prefill costs the batch: its own compute and the local prefills queued ahead of
it stall every member (`AdmitContext.with_prefill_stall`); alone, its own. It is
refused (tbt_slo) when that stall would make a request already booked on the
instance miss its TBT target: every local prefill booked there is counted against
each member's mean time between tokens (`DecodeLoad.stall_room`), so a stream
of small local prefills cannot wear a decoding request's TPOT down unseen.
"""

import random
from dataclasses import dataclass, replace
from typing import Protocol

from libs.protocol.vocabulary import ErrorCode, Role
from services.conductor.affinity import Home, stay_or_move
from services.conductor.cluster import ClusterView, Instance
from services.conductor.predict import AdmitContext, DecodeEstimate, PrefillEstimate, step_now
from services.conductor.routers import (
    OPTIONS,
    ROUTERS,
    Decision,
    Route,
    Router,
    build_router,
    local_route,
    missing_roles,
)

_SLACK = 1e-9  # seconds: a prediction equal to the SLO meets it


@dataclass(frozen=True)
class Verdict:
    decode: DecodeEstimate  # the TBT prediction the verdict rests on (settled against the measured TBT)
    rejection: Decision | None = None  # None: admit
    best_effort: bool = False  # admitted without an SLO to keep (asked for, or its TBT misses even alone)
    prefill: PrefillEstimate | None = None  # the TTFT prediction, queue as placed in the instance's order


class Admission(Protocol):
    name: str

    def judge(self, ctx: AdmitContext, route: Route) -> Verdict: ...


class AdmitAll:
    name = "none"

    def judge(self, ctx: AdmitContext, route: Route) -> Verdict:
        return Verdict(route.decode)


class EarlyRejection:
    name = "early_rejection"

    def decode_estimate(self, ctx: AdmitContext, d: Instance, ttft_s: float) -> DecodeEstimate:
        return ctx.decode_now(d)

    def judge(self, ctx: AdmitContext, route: Route) -> Verdict:
        request, slo = ctx.request, ctx.slo
        slack = ctx.ttft_slack  # what the cost model does not see of a TTFT, learned
        p = route.prefill
        judged = not request.moved and not request.best_effort  # a moved request is never refused
        if judged and p.unloaded_ttft_s + slack > slo.ttft_s + _SLACK:
            message = (f"predicted TTFT {p.unloaded_ttft_s:.3f} s{_plus(slack)} on {p.instance_id} even with "
                       f"nothing queued exceeds the {slo.ttft_s:.3f} s target; send it as best effort "
                       f"(x-kvserve-slo: best-effort) or with a TTFT target it can meet")  # fmt: skip
            return Verdict(route.decode, _reject("slo_unattainable", message, None, route,
                                                 ttft_s=p.unloaded_ttft_s + slack))  # fmt: skip
        breaks: tuple[str, ...] = ()
        if not route.is_local:  # where it lands in the prefill instance's order, and what that delays
            placement = ctx.view.get(p.instance_id).prefill.place(request.request_id, p.work_s, ctx.now,
                                                                  ctx.prefill_deadline, ctx.favored)  # fmt: skip
            p = replace(p, queue_s=max(0.0, placement.done_at - ctx.now - p.work_s))
            route, breaks = replace(route, prefill=p), placement.breaks
        ttft = p.ttft_s + slack
        if judged and ttft > slo.ttft_s + _SLACK:
            message = (f"predicted TTFT {p.ttft_s:.3f} s{_plus(slack)} on {p.instance_id} (queue {p.queue_s:.3f} s) "
                       f"exceeds the {slo.ttft_s:.3f} s target")  # fmt: skip
            return Verdict(route.decode, _reject("ttft_slo", message, ttft - slo.ttft_s, route, ttft_s=ttft), p)
        if judged and breaks:
            message = (f"admitting it on {p.instance_id} would make {len(breaks)} admitted request(s) miss their "
                       f"TTFT target ({', '.join(breaks[:3])})")  # fmt: skip
            return Verdict(route.decode, _reject("ttft_slo", message, p.work_s, route, ttft_s=ttft), p)
        # shorter prompts arriving meanwhile go first (overload.py); never on an instance that is
        # idle or about to be (what is booked ends within a chunk), nor ahead of a favored request
        # (those of tenants further over their shares go after it)
        rho = (ctx.shorter_share if not (route.is_local or ctx.favored)
               and not ctx.view.get(p.instance_id).prefill.about_idle(ctx.now) else 0.0)  # fmt: skip
        if judged and rho > 0 and p.ttft_s / (1 - rho) + slack > slo.ttft_s + _SLACK:  # rho < 1: overload.MAX_SHARE
            pushed = p.ttft_s / (1 - rho)
            message = (f"predicted TTFT {p.ttft_s:.3f} s{_plus(slack)} on {p.instance_id}, {pushed:.3f} s{_plus(slack)} with the "
                       f"shorter prompts that take {rho:.0%} of it going first, exceeds the {slo.ttft_s:.3f} s target")  # fmt: skip
            return Verdict(route.decode, _reject("ttft_slo", message, p.work_s, route, ttft_s=pushed + slack), p)
        d = ctx.view.get(route.decode.instance_id)
        tbt = self.decode_estimate(ctx, d, ttft)
        alone = ctx.decode_estimate(d, (0, 0))
        if route.is_local:  # the batch waits for the prefills queued on d and for this one
            tbt = ctx.with_prefill_stall(tbt, p.queue_s + p.compute_s)
            alone = ctx.with_prefill_stall(alone, p.compute_s)
            room = ctx.stall_room(d)
            if judged and p.compute_s > room + _SLACK:  # the promises made to the batch it would stall
                message = (f"prefilling it on {d.instance_id} ({p.compute_s:.3f} s between decode steps) would make "
                           f"a request decoding there miss its TBT target ({max(room, 0.0):.3f} s of stall left)")
                return Verdict(tbt, _reject("tbt_slo", message, _decode_wait(ctx, d, tbt, slo.tbt_s), route), p)
        elif backlog := d.prefill.backlog(ctx.now):  # a handed-over request waits for d's own prefills too
            tbt = ctx.with_prefill_stall(tbt, backlog)
        margin = ctx.margins.tbt(d.instance_id)
        limit = max(slo.tbt_s, alone.tbt_s * margin)
        best_effort = request.best_effort or limit > slo.tbt_s
        if request.moved:
            return Verdict(tbt, best_effort=best_effort, prefill=p)
        if not tbt.fits:
            message = f"{d.instance_id} is predicted to have no room for this request's KV (batch {tbt.batch_size})"
            return Verdict(tbt, _reject("decode_full", message, _decode_wait(ctx, d, tbt, limit / margin), route), p)
        if tbt.tbt_s * margin > limit + _SLACK:
            message = (f"predicted TBT {tbt.tbt_s * 1e3:.1f} ms{_times(margin)} on {d.instance_id} (batch "
                       f"{tbt.batch_size}) exceeds the {limit * 1e3:.1f} ms target")  # fmt: skip
            return Verdict(tbt, _reject("tbt_slo", message, _decode_wait(ctx, d, tbt, limit / margin), route,
                                        tbt_s=tbt.tbt_s * margin), p)  # fmt: skip
        return Verdict(tbt, best_effort=best_effort, prefill=p)


class PredictiveRejection(EarlyRejection):
    name = "predictive_rejection"

    def decode_estimate(self, ctx: AdmitContext, d: Instance, ttft_s: float) -> DecodeEstimate:
        return ctx.decode_at(d, ctx.now + ttft_s)


def _times(margin: float) -> str:
    return "" if margin == 1.0 else f" x margin {margin:.2f}"


def _plus(slack: float) -> str:
    return "" if slack == 0.0 else f" + {slack:.3f} s slack"


def _reject(
    reason: str, message: str, wait_s: float | None, route: Route, ttft_s: float | None = None,
    tbt_s: float | None = None,
) -> Decision:
    """A refusal that reports the prediction it compared with the target (margin included)."""
    return Decision(
        prefill_id=route.prefill.instance_id, decode_id=route.decode.instance_id,
        predicted_ttft_s=route.prefill.ttft_s if ttft_s is None else ttft_s,
        predicted_tbt_s=route.decode.tbt_s if tbt_s is None else tbt_s,
        error_code=ErrorCode.REJECTED, error_message=message, reason=reason,
        retry_after_s=None if wait_s is None else max(wait_s, 0.0),
    )  # fmt: skip


def _decode_wait(ctx: AdmitContext, d: Instance, tbt: DecodeEstimate, limit: float) -> float:
    """Seconds until enough of ``d``'s requests are predicted to finish for this one to fit."""
    ends = d.decode.expected_ends(ctx.now, ctx.step_now(d))
    n = ctx.num_sequences
    size = tbt.batch_size - n  # the others
    per_seq = ctx.added_context() / n
    for i, end in enumerate(ends):
        left = size - (i + 1)
        if d.cost.decode_step_time(left + n, (left + n) * per_seq) <= limit:
            return end - ctx.now
    return ctx.decode_duration(d)


class Policy:
    """A router, an admission rule and, optionally, conditional disaggregation: with
    ``local_prefill`` a decode instance prefills a request itself when that is
    predicted faster and its longest stall of the batch (one of the chunks the
    instance computes between two decode steps, or the whole prompt if shorter)
    keeps that batch within the TBT target, and every request when no prefill
    instance is alive. A cluster that has never
    had a prefill instance (a colocated deployment, however it was started) is
    served that way whatever the options: each decode instance prefills its own
    requests, and the admission rule still judges them, stall included. One whose
    prefill instances are all gone refuses (NO_PREFILL) without ``local_prefill``,
    until one is back."""

    def __init__(self, router: Router, admission: Admission, local_prefill: bool = False, name: str = "") -> None:
        self.router = router
        self.admission = admission
        self.local_prefill = local_prefill
        self.name = name or router.name

    @property
    def replication(self) -> bool:
        """Whether a prefill instance may copy a longer prefix from a peer (the router's option)."""
        return self.router.replication

    def prefills_on_decode(self, view: ClusterView) -> bool:
        """Whether a request needs no prefill instance here: the decode instances prefill
        it when none is alive."""
        return self.local_prefill or Role.PREFILL not in view.roles_seen

    def choose(self, ctx: AdmitContext, home: Home | None = None) -> Decision:
        """The route for ``ctx``'s request (a session's turn: near ``home``, its last turn's)."""
        colocated = not ctx.prefills and bool(ctx.decodes) and self.prefills_on_decode(ctx.view)
        missing = None if colocated else missing_roles(ctx.prefills, ctx.decodes)
        if missing is not None:
            return missing
        route, affinity = self.router.route_local(ctx) if colocated else self.router.route(ctx), None
        if home is not None:
            route, affinity = stay_or_move(ctx, route, home)
        on_decode = colocated
        if colocated:  # the only route there is, whatever it costs: admission decides
            route = local_route(ctx, ctx.view.get(route.decode.instance_id))  # the decode instance affinity kept
        elif self.local_prefill:
            d = ctx.view.get(route.decode.instance_id)
            local = local_route(ctx, d)
            # only a prefill whose longest stall of the decode batch (all of it, or one chunk of it)
            # keeps that batch within its TBT target
            stall = local.prefill.compute_s
            if d.prefill.chunk_s is not None:
                stall = min(stall, d.prefill.chunk_s)
            within = (stall + step_now(d)) * ctx.margins.tbt(d.instance_id) <= ctx.slo.tbt_s
            # and that the requests decoding there can take it: each one's mean time between
            # tokens, stalls already booked beside it included, stays within the target
            within = within and local.prefill.compute_s <= ctx.stall_room(d)
            if within and local.prefill.ttft_s < route.prefill.ttft_s:
                route, on_decode = local, True
        verdict = self.admission.judge(ctx, route)
        if verdict.rejection is not None:
            return replace(verdict.rejection, prefill_on_decode=on_decode, affinity=affinity)
        p = verdict.prefill or route.prefill
        return Decision(
            prefill_id=p.instance_id, decode_id=route.decode.instance_id, prefill_on_decode=on_decode,
            predicted_ttft_s=p.ttft_s, predicted_tbt_s=verdict.decode.tbt_s, best_effort=verdict.best_effort,
            cached_tokens=p.cached_tokens, affinity=affinity,
            work_s=p.work_s, prefill_speed=p.speed, copy_from=p.copy_from, copy_blocks=p.copy_blocks,
        )  # fmt: skip


def build_policy(spec: str, rng: random.Random | None = None) -> Policy:
    """``router[+option...]``, e.g. ``cache_aware+replication+predictive_rejection``."""
    name, *options = [part.strip() for part in spec.split("+")]
    if name not in ROUTERS:
        raise ValueError(f"unknown policy {spec!r}: it must start with one of {', '.join(ROUTERS)}")
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise ValueError(f"unknown policy option {unknown[0]!r}; options: {', '.join(OPTIONS)}")
    if "replication" in options and name != "cache_aware":
        raise ValueError("replication needs the cache_aware router")
    if "early_rejection" in options and "predictive_rejection" in options:
        raise ValueError("choose early_rejection or predictive_rejection, not both")
    admission: Admission = AdmitAll()
    if "early_rejection" in options:
        admission = EarlyRejection()
    elif "predictive_rejection" in options:
        admission = PredictiveRejection()
    router = build_router(name, "replication" in options, rng)
    return Policy(router, admission, "local_prefill" in options, "+".join([name, *options]))
