"""Weighted fair shares among tenants under overload.

A tenant's usage is its work in flight (admitted, not finished) plus the work it
was admitted lately, each admission's cost fading with a time constant of
``USAGE_S``: what the tenant has taken of the cluster over the last seconds, not
only at this instant. (Counted in flight alone, a light tenant with one long
prompt running would be over its share against a flooder whose requests are
being refused: its next short prompt would be refused for fairness, and the
flooder's favored ahead of its long one.) Each active tenant's share of the usage is its
weight over the weights of the active tenants: those with work in flight or a
request seen in the last ``ACTIVE_S`` seconds (a light tenant whose requests
finish fast is still there, and the room it needs is kept for it). A request's
cost is its prompt tokens plus its expected output tokens (prefill work and a
decode slot's tokens). Shares apply only under pressure — the queue ahead of the
request (its predicted TTFT less its own prefill, plus the learned slack) takes
more than ``pressure`` of its TTFT target — and only to a tenant already over its
share before the request, and the furthest over: its requests are refused (reason
``fair_share``) while the others' are still judged by their SLOs alone, so the
room left in the queue goes to the tenants under their share. A tenant alone (no
other active) or within its share is never refused for it: work-conserving.

Each conductor replica counts the admissions it made itself. Pure bookkeeping.
"""

import math
from dataclasses import dataclass

from libs.protocol.ids import RequestId

ACTIVE_S = 10.0  # a tenant that sent a request this recently still has a share
USAGE_S = 10.0  # an admission's cost counts against its tenant's share, fading with this time constant

@dataclass(frozen=True)
class FairShareConfig:
    pressure: float = 0.5  # 0..1: the share of its TTFT target a request's predicted TTFT must take; >= 1: off


@dataclass(frozen=True)
class Charge:
    tenant: str
    weight: float
    cost: float


class FairShare:
    def __init__(self, config: FairShareConfig | None = None) -> None:
        self.config = config or FairShareConfig()
        self._charges: dict[str, Charge] = {}  # by request id
        self._cost: dict[str, float] = {}  # in flight, by tenant
        self._weight: dict[str, float] = {}  # the latest weight each tenant in flight was admitted with
        self._seen: dict[str, tuple[float, float]] = {}  # tenant -> (when it last sent a request, its weight)
        self._recent: dict[str, tuple[float, float]] = {}  # tenant -> (admitted cost, faded as of when)

    def arrived(self, tenant: str, weight: float, now: float) -> None:
        """A request of ``tenant`` arrived (admitted or not): it is active for ACTIVE_S."""
        self._seen[tenant] = (now, weight)
        if len(self._seen) > 1000:  # forget the long gone
            self._seen = {t: s for t, s in self._seen.items() if s[0] >= now - ACTIVE_S}
            self._recent = {t: r for t, r in self._recent.items() if t in self._seen or t in self._cost}

    def add(self, request_id: RequestId, tenant: str, weight: float, cost: float, now: float = 0.0) -> None:
        self.remove(request_id)
        self._charges[request_id] = Charge(tenant, weight, cost)
        self._cost[tenant] = self._cost.get(tenant, 0.0) + cost
        self._weight[tenant] = weight
        self._recent[tenant] = (self._faded(tenant, now) + cost, now)

    def remove(self, request_id: RequestId) -> None:
        charge = self._charges.pop(request_id, None)
        if charge is None:
            return
        left = self._cost[charge.tenant] - charge.cost
        if left <= 1e-9:
            del self._cost[charge.tenant], self._weight[charge.tenant]
        else:
            self._cost[charge.tenant] = left

    def in_flight(self, tenant: str) -> float:
        return self._cost.get(tenant, 0.0)

    def usage(self, tenant: str, now: float) -> float:
        """Its work in flight plus its admissions' faded costs."""
        return self._cost.get(tenant, 0.0) + self._faded(tenant, now)

    def _faded(self, tenant: str, now: float) -> float:
        cost, at = self._recent.get(tenant, (0.0, now))
        return cost * math.exp(-max(0.0, now - at) / USAGE_S)

    def _weights(self, now: float, tenant: str, weight: float) -> dict[str, float]:
        """The weights of the active tenants, ``tenant`` included."""
        recent = {t: w for t, (at, w) in self._seen.items() if at >= now - ACTIVE_S}
        return {**recent, **self._weight, tenant: weight}

    def ratios(self, tenant: str, weight: float, cost: float, now: float = 0.0) -> dict[str, float]:
        """Each active tenant's usage over its weighted share of all of theirs, were this request admitted."""
        weights = self._weights(now, tenant, weight)
        costs = {t: self.usage(t, now) for t in weights}
        costs[tenant] += cost
        total, total_weight = sum(costs.values()), sum(weights.values())
        if total <= 0:
            return dict.fromkeys(costs, 0.0)  # nothing in flight: nobody is over a share of it
        return {t: c / (weights[t] / total_weight * total) for t, c in costs.items()}

    def favors(self, tenant: str, weight: float, now: float = 0.0) -> bool:
        """Whether ``tenant``'s next request goes before the others' work: another active
        tenant is further over its weighted share of the usage than it is."""
        ratios = self.ratios(tenant, weight, 0.0, now)
        mine = ratios.pop(tenant)
        return bool(ratios) and mine < max(ratios.values())

    def refuses(self, tenant: str, weight: float, cost: float, pressure: float, now: float = 0.0) -> float | None:
        """Its ratio to its share when this request is to be refused for fairness, else None:
        under pressure (``pressure``: its predicted TTFT over its target), with another
        tenant active, and its tenant over its share and the furthest over."""
        if pressure <= self.config.pressure or self.config.pressure >= 1:
            return None
        ratios = self.ratios(tenant, weight, cost, now)
        if len(ratios) < 2 or self.ratios(tenant, weight, 0.0, now)[tenant] <= 1.0:
            return None  # alone, or not over its share before this request (a tenant's first is never refused)
        mine = ratios[tenant]
        return mine if mine >= max(ratios.values()) else None
