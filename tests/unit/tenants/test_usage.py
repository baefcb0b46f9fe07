"""Per-tenant usage: counters with a bounded tenant label, and the totals /v1/usage shows."""

from libs.common.metrics import Metrics
from libs.common.tenants import Tenant
from services.gateway import tenant_usage
from services.gateway.response_bodies import Usage
from services.gateway.tenant_usage import TenantUsage


def test_requests_tokens_and_refusals_count_per_tenant():
    usage = TenantUsage(Metrics("gw", "gateway", "m"))
    a, b = Tenant("a"), Tenant("b")
    usage.observe(a, Usage(100, 7, 64))
    usage.observe(a, Usage(10, 3, 0))
    usage.observe(b, Usage(5, 1, 0))
    usage.refused(a, "requests_per_minute")
    usage.refused(a, "requests_per_minute")
    assert usage.of(a) == {"requests": 2, "prompt_tokens": 110, "cached_tokens": 64, "completion_tokens": 10,
                           "refusals": {"requests_per_minute": 2}}  # fmt: skip
    assert usage.of(b)["requests"] == 1 and usage.of(Tenant("c"))["requests"] == 0
    assert usage.prompt_tokens.value("a") == 110 and usage.cached_tokens.value("a") == 64
    assert usage.completion_tokens.value("b") == 1
    assert usage.refusals.value("a", "requests_per_minute") == 2


def test_the_tenant_label_is_bounded(monkeypatch):
    monkeypatch.setattr(tenant_usage, "MAX_TENANT_LABELS", 2)
    usage = TenantUsage(Metrics("gw", "gateway", "m"))
    for name in ("a", "b", "c", "d"):
        usage.observe(Tenant(name), Usage(1, 1, 0))
    assert (usage.requests.value("a"), usage.requests.value("b"), usage.requests.value("other")) == (1, 1, 2)
    assert usage.of(Tenant("d"))["requests"] == 1  # its own totals stay its own
