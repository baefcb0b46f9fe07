"""What the console shows, as one JSON-ready dict: the cluster from the heartbeats
the gateway hears, the conductors' KV map and routing decisions, and the requests
this gateway served (TTFT, TPOT, SLO attainment, cache hits) over the last minutes,
and each tenant's use: every tenant's to an admin, its own to any other tenant.

`RequestLog` keeps the served requests; `console_state` is a pure function of
its inputs, so tests build it from fakes. Nothing here touches NATS or HTTP.
"""

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgspec

from libs.common.tenants import Tenant
from libs.protocol.ids import RequestId
from libs.protocol.schema import ConductorViewReply, Heartbeat
from libs.protocol.vocabulary import FinishReason, Role
from services.gateway.tenant_usage import OTHER, UsageTotals

HORIZON_S = 900.0  # served requests are kept this long ...
MAX_SERVED = 20_000  # ... and at most this many
WINDOW_S = 300.0  # the charts and the SLO summary cover the last five minutes
BUCKET_S = 10.0  # one chart point per this many seconds
ROLE_ORDER = {role: i for i, role in enumerate((Role.GATEWAY, Role.CONDUCTOR, Role.PREFILL, Role.DECODE, Role.STORE))}
COMPLETED = (FinishReason.STOP, FinishReason.LENGTH)


@dataclass(frozen=True)
class Served:
    """One request this gateway served, once it was over."""

    request_id: RequestId
    at: float  # wall-clock seconds when it ended
    prefill_id: str | None
    decode_id: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_completion_tokens: int
    ttft_s: float | None  # None: no token came
    tpot_s: float | None  # mean time per output token after the first; None: fewer than two tokens
    finish_reason: str | None  # None: it failed or the client left
    migrations: int = 0
    slo_ttft_s: float | None = None  # the request's own targets; None: the conductor's
    slo_tbt_s: float | None = None
    tenant: str | None = None  # the tenant that sent it (None: no tenant, as a test may run it)

    def missed(self, slo_ttft_s: float, slo_tbt_s: float) -> str | None:
        """Which target it missed ("failed": it did not complete), judged against its own
        targets where it set them, else these; None: it met them all."""
        if self.finish_reason not in COMPLETED or self.ttft_s is None:
            return "failed"
        if self.ttft_s > (self.slo_ttft_s or slo_ttft_s):
            return "ttft"
        if self.tpot_s is not None and self.tpot_s > (self.slo_tbt_s or slo_tbt_s):
            return "tpot"
        return None

    def met(self, slo_ttft_s: float, slo_tbt_s: float) -> bool:
        """Completed within both of its targets."""
        return self.missed(slo_ttft_s, slo_tbt_s) is None


class RequestLog:
    """The requests served in the last ``horizon_s`` seconds, oldest first; a waiter
    on `wait_changed` wakes when one more is logged."""

    def __init__(self, horizon_s: float = HORIZON_S, max_served: int = MAX_SERVED,
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        self.horizon_s = horizon_s
        self.clock = clock
        self._served: deque[Served] = deque(maxlen=max_served)
        self._changed = asyncio.Event()
        self.version = 0  # one more for every request logged

    def add(self, served: Served) -> None:
        self._served.append(served)
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def observe(self, generation: Any) -> None:
        """Log a `generation.Generation` that is over (a `Generations` observer)."""
        run, text = generation.run, generation.text
        served_by = run.served_by()
        n = text.num_completion_tokens
        ttft = run.ttft_s
        tpot = None
        if ttft is not None and n > 1 and generation.ended_at is not None:
            tpot = max(generation.ended_at - generation.started_at - ttft, 0.0) / (n - 1)
        slo = generation.slo
        self.add(Served(
            request_id=run.request_id, at=self.clock(), prefill_id=(served_by["prefill_instances"] or [None])[0],
            decode_id=(served_by["decode_instances"] or [None])[-1], num_prompt_tokens=text.num_prompt_tokens,
            num_cached_tokens=text.num_cached_tokens, num_completion_tokens=n, ttft_s=ttft, tpot_s=tpot,
            finish_reason=text.finish_reason, migrations=run.migrations,
            slo_ttft_s=slo.ttft_s if slo else None, slo_tbt_s=slo.tbt_s if slo else None,
            tenant=generation.tenant.name if generation.tenant is not None else None,
        ))  # fmt: skip

    def recent(self) -> list[Served]:
        """Oldest first, within the horizon."""
        cutoff = self.clock() - self.horizon_s
        while self._served and self._served[0].at < cutoff:
            self._served.popleft()
        return list(self._served)

    async def wait_changed(self, timeout: float) -> bool:
        """Wait until a request is logged or ``timeout`` seconds pass; True if one was."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            return False
        return True


# --- the state the console draws --------------------------------------------------------
def console_state(
    gateway: dict[str, Any],
    heard: Sequence[tuple[Heartbeat, float]],
    views: Sequence[ConductorViewReply],
    unreachable: Sequence[str],
    served: Sequence[Served],
    now: float,
    max_decisions: int = 20,
    max_requests: int = 20,
    usage: Mapping[str, UsageTotals] | None = None,
    tenant_label: Callable[[str], str] = str,
) -> dict[str, Any]:
    """Everything the page and `kvserve status` show, JSON-ready, as an admin sees it
    (`for_caller` narrows it for any other tenant). ``heard``: every live instance's
    last heartbeat and its age; ``views``: what each conductor answered
    (``unreachable``: the conductors that did not); ``served``: oldest first;
    ``usage``: each tenant's totals, shown under ``tenant_label`` of its name."""
    blocks: dict[str, dict[str, int]] = {}
    for view in views:
        for instance_id, tiers in view.blocks.items():
            blocks.setdefault(instance_id, {}).update(tiers)
    slo_ttft, slo_tbt = (views[0].slo_ttft_s, views[0].slo_tbt_s) if views else (None, None)
    window = [s for s in served if s.at >= now - WINDOW_S]
    by_id = {s.request_id: s for s in served}
    return {
        "time": now,
        "gateway": gateway,
        "instances": [_instance(hb, age, blocks.get(hb.instance_id, {}), now) for hb, age in _ordered(heard)],
        "conductors": [{"instance_id": v.instance_id, "policy": v.policy, "slo_ttft_s": v.slo_ttft_s,
                        "slo_tbt_s": v.slo_tbt_s, "learned": msgspec.to_builtins(v.learned)} for v in views]  # fmt: skip
        + [{"instance_id": c, "error": "did not answer"} for c in unreachable],
        "kv_map": {"blocks": blocks, "hot_prefixes": _hot_prefixes(views)},
        "decisions": _decisions(views, by_id, max_decisions),
        "requests": [_served(s, slo_ttft, slo_tbt) for s in reversed(served[-max_requests:])],
        "slo": _summary(window, slo_ttft, slo_tbt),
        "series": _series(window, slo_ttft, slo_tbt, now),
        "tenants": tenant_rows(usage or {}, window, slo_ttft, slo_tbt, tenant_label),
    }


# --- tenants --------------------------------------------------------------------------
def tenant_rows(usage: Mapping[str, UsageTotals], window: Sequence[Served], slo_ttft: float | None,
                slo_tbt: float | None, label: Callable[[str], str] = str) -> list[dict[str, Any]]:  # fmt: skip
    """One row per tenant label (the metrics' bounded label: past its first tenants,
    the rest add up under ``other``), by name, ``other`` last: requests, tokens and
    refusals by reason since the gateway started; SLO met and missed over ``window``
    (None without known targets)."""
    rows: dict[str, dict[str, Any]] = {}

    def row(name: str) -> dict[str, Any]:
        return rows.setdefault(label(name), {
            "tenant": label(name), "requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
            "refusals": {}, "slo_met": None if slo_ttft is None else 0, "slo_missed": None if slo_ttft is None else 0,
        })  # fmt: skip

    for name, totals in usage.items():
        r = row(name)
        for field in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens"):
            r[field] += getattr(totals, field)
        for reason, n in totals.refusals.items():
            r["refusals"][reason] = r["refusals"].get(reason, 0) + n
    if slo_ttft is not None:
        for s in window:
            if s.tenant is not None:
                row(s.tenant)["slo_met" if s.met(slo_ttft, slo_tbt) else "slo_missed"] += 1
    return sorted(rows.values(), key=lambda r: (r["tenant"] == OTHER, r["tenant"]))


def for_caller(state: dict[str, Any], caller: Tenant | None, usage: Mapping[str, UsageTotals],
               served: Sequence[Served]) -> dict[str, Any]:  # fmt: skip
    """``state`` as ``caller`` may see it: an admin (an `admin = true` tenant, the one
    ``--api-key``, or anyone where no key is set) sees everything; any other tenant its
    own row only, counted by its own name (never merged under ``other``), and its own
    requests only, without the routing decisions and hot prefixes, which would show
    whether another tenant's prompts are cached."""
    if caller is None or caller.admin:
        return state
    slo = state["slo"]
    mine = [s for s in served if s.tenant == caller.name]
    window = [s for s in mine if s.at >= state["time"] - WINDOW_S]
    own = {caller.name: usage.get(caller.name, UsageTotals())}
    shown = len(state["requests"])
    return {
        **state,
        "tenants": tenant_rows(own, window, slo["ttft_s"], slo["tbt_s"]),
        "requests": [_served(s, slo["ttft_s"], slo["tbt_s"]) for s in reversed(mine[-shown:])] if shown else [],
        "decisions": [],
        "kv_map": {**state["kv_map"], "hot_prefixes": []},
    }


def _ordered(heard: Sequence[tuple[Heartbeat, float]]) -> list[tuple[Heartbeat, float]]:
    return sorted(heard, key=lambda item: (ROLE_ORDER.get(item[0].role, 99), item[0].instance_id))


def _instance(hb: Heartbeat, age: float, tiers: dict[str, int], now: float) -> dict[str, Any]:
    usage = None
    if hb.capacity:
        usage = (hb.capacity - hb.free_blocks) / hb.capacity
    return {
        "instance_id": hb.instance_id, "role": hb.role, "host_id": hb.host_id, "address": hb.address,
        "load": hb.load, "kv_capacity_blocks": hb.capacity, "kv_free_blocks": hb.free_blocks, "kv_usage": usage,
        "queued_tokens": hb.queued_tokens, "batch_size": hb.batch_size, "context_tokens": hb.context_tokens,
        "tiers": tiers, "cost": msgspec.to_builtins(hb.cost) if hb.cost is not None else None,
        "uptime_s": max(now - hb.started_at, 0.0) if hb.started_at else None, "last_heard_s": age,
    }  # fmt: skip


def _hot_prefixes(views: Sequence[ConductorViewReply]) -> list[dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for view in views:
        for p in view.hot_prefixes:
            entry = merged.setdefault(p.block_hash, {"block_hash": p.block_hash, "num_blocks": p.num_blocks,
                                                     "hits": 0, "holders": {}})  # fmt: skip
            entry["hits"] += p.hits
            entry["holders"].update(p.holders)
    return sorted(merged.values(), key=lambda e: -e["hits"])


def _decisions(views: Sequence[ConductorViewReply], by_id: dict[str, Served], limit: int) -> list[dict[str, Any]]:
    decisions = sorted((d for v in views for d in v.decisions), key=lambda d: -d.at)[:limit]
    out = []
    for d in decisions:
        entry = msgspec.to_builtins(d)
        served = by_id.get(d.request_id)
        entry["actual"] = None if served is None else {
            "ttft_s": served.ttft_s, "tpot_s": served.tpot_s, "cached_tokens": served.num_cached_tokens,
            "prompt_tokens": served.num_prompt_tokens, "finish_reason": served.finish_reason,
        }  # fmt: skip
        out.append(entry)
    return out


def _served(s: Served, slo_ttft: float | None, slo_tbt: float | None) -> dict[str, Any]:
    entry = asdict(s)
    entry["slo_missed"] = None if slo_ttft is None else s.missed(slo_ttft, slo_tbt)
    entry["slo_met"] = None if slo_ttft is None else entry["slo_missed"] is None
    return entry


def _summary(window: list[Served], slo_ttft: float | None, slo_tbt: float | None) -> dict[str, Any]:
    prompt = sum(s.num_prompt_tokens for s in window)
    cached = sum(s.num_cached_tokens for s in window)
    met = None if slo_ttft is None else sum(s.met(slo_ttft, slo_tbt) for s in window)
    ttft_p50, ttft_p90 = _quantiles([s.ttft_s for s in window])
    tpot_p50, tpot_p90 = _quantiles([s.tpot_s for s in window])
    return {
        "window_s": WINDOW_S, "ttft_s": slo_ttft, "tbt_s": slo_tbt, "requests": len(window), "met": met,
        "attainment": met / len(window) if window and met is not None else None,
        "ttft_p50_s": ttft_p50, "ttft_p90_s": ttft_p90, "tpot_p50_s": tpot_p50, "tpot_p90_s": tpot_p90,
        "prompt_tokens": prompt, "cached_tokens": cached, "cache_hit": cached / prompt if prompt else None,
    }  # fmt: skip


def _series(window: list[Served], slo_ttft: float | None, slo_tbt: float | None, now: float) -> dict[str, list]:
    """One point per BUCKET_S over the window (None where no request ended), oldest first."""
    n = int(WINDOW_S // BUCKET_S)
    end = now - now % BUCKET_S + BUCKET_S
    buckets: list[list[Served]] = [[] for _ in range(n)]
    for s in window:
        i = n - 1 - int((end - s.at) // BUCKET_S)
        if 0 <= i < n:
            buckets[i].append(s)
    series: dict[str, list] = {"t": [end - (n - i) * BUCKET_S for i in range(n)], "requests": [len(b) for b in buckets]}
    for field in ("ttft_s", "tpot_s"):
        p50s, p90s = zip(*(_quantiles([getattr(s, field) for s in b]) for b in buckets))
        series[f"{field[:4]}_p50_s"], series[f"{field[:4]}_p90_s"] = list(p50s), list(p90s)
    series["attainment"] = [
        sum(s.met(slo_ttft, slo_tbt) for s in b) / len(b) if b and slo_ttft is not None else None for b in buckets
    ]
    return series


def _quantiles(values: Sequence[float | None], qs: Sequence[float] = (0.5, 0.9)) -> tuple[float | None, ...]:
    """The nearest-rank quantiles ``qs`` of the values that are not None (one sort for all)."""
    present = sorted([v for v in values if v is not None])
    if not present:
        return (None,) * len(qs)
    return tuple(present[max(math.ceil(q * len(present)) - 1, 0)] for q in qs)
