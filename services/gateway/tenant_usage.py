"""What each tenant has used of this gateway since it started: requests, prompt,
cached and completion tokens, refusals by reason; as Prometheus counters with a
``tenant`` label and as the totals `GET /v1/usage` shows a tenant of its own.

The label is bounded: the first MAX_TENANT_LABELS tenants seen get their own
value, any later one counts under ``other`` (its /v1/usage totals stay its own).
Told of each request that ends and each refusal by `Generations`, on the event loop.
"""

from dataclasses import asdict, dataclass, field
from typing import Any

from libs.common.metrics import Metrics
from libs.common.tenants import DEFAULT_TENANT, Tenant
from services.gateway.response_bodies import Usage

MAX_TENANT_LABELS = 100
OTHER = "other"


@dataclass
class UsageTotals:
    requests: int = 0  # admitted and run (refused ones are in refusals)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    refusals: dict[str, int] = field(default_factory=dict)  # by reason


class TenantUsage:
    def __init__(self, metrics: Metrics) -> None:
        m = metrics
        self.requests = m.counter("kvserve_tenant_requests_total", "Requests run for a tenant", ["tenant"])
        self.prompt_tokens = m.counter("kvserve_tenant_prompt_tokens_total", "Prompt tokens of a tenant's requests",
                                       ["tenant"])  # fmt: skip
        self.cached_tokens = m.counter("kvserve_tenant_cached_tokens_total",
                                       "Prompt tokens of a tenant's requests served from its KV cache", ["tenant"])
        self.completion_tokens = m.counter("kvserve_tenant_completion_tokens_total",
                                           "Tokens generated for a tenant", ["tenant"])  # fmt: skip
        self.refusals = m.counter("kvserve_tenant_refusals_total",
                                  "A tenant's requests refused (429), by reason: a quota, or the conductor's",
                                  ["tenant", "reason"])  # fmt: skip
        self.totals: dict[str, UsageTotals] = {}
        self._labels: set[str] = set()

    def observe(self, tenant: Tenant | None, usage: Usage) -> None:
        name = _name(tenant)
        totals = self.totals.setdefault(name, UsageTotals())
        totals.requests += 1
        totals.prompt_tokens += usage.prompt_tokens
        totals.cached_tokens += usage.cached_tokens
        totals.completion_tokens += usage.completion_tokens
        label = self.label(name)
        self.requests.labels(label).inc()
        self.prompt_tokens.labels(label).inc(usage.prompt_tokens)
        self.cached_tokens.labels(label).inc(usage.cached_tokens)
        self.completion_tokens.labels(label).inc(usage.completion_tokens)

    def refused(self, tenant: Tenant | None, reason: str) -> None:
        name = _name(tenant)
        refusals = self.totals.setdefault(name, UsageTotals()).refusals
        refusals[reason] = refusals.get(reason, 0) + 1
        self.refusals.labels(self.label(name), reason).inc()

    def of(self, tenant: Tenant | None) -> dict[str, Any]:
        """``tenant``'s totals, as `GET /v1/usage` shows them."""
        return asdict(self.totals.get(_name(tenant), UsageTotals()))

    def label(self, name: str) -> str:
        """``name``'s value of the ``tenant`` label: its own among the first
        MAX_TENANT_LABELS tenants seen, else ``other``."""
        if name in self._labels:
            return name
        if len(self._labels) < MAX_TENANT_LABELS:
            self._labels.add(name)
            return name
        return OTHER


def _name(tenant: Tenant | None) -> str:
    return DEFAULT_TENANT if tenant is None else tenant.name
