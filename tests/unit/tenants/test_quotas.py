"""Quotas per tenant, on a clock the test moves: each limit refuses with its reason
and OpenAI's x-ratelimit-* headers, refills over a minute, and gives back unused tokens."""

import pytest

from libs.common.tenants import Quotas as Limits
from libs.common.tenants import Tenant
from services.gateway.errors import QuotaExceededError, to_http
from services.gateway.quotas import Quotas


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refusal(quotas: Quotas, tenant: Tenant, prompt: int = 10, max_tokens: int = 10) -> QuotaExceededError:
    with pytest.raises(QuotaExceededError) as e:
        quotas.acquire(tenant, prompt, max_tokens)
    return e.value


def test_requests_per_minute_refill_continuously_and_say_so_in_the_headers():
    clock = Clock()
    quotas, tenant = Quotas(clock), Tenant("a", quotas=Limits(requests_per_minute=2))
    first = quotas.acquire(tenant, 10, 10)
    assert first.headers == {"x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "1",
                             "x-ratelimit-reset-requests": "30s"}  # fmt: skip
    quotas.acquire(tenant, 10, 10)
    error = refusal(quotas, tenant)
    assert (error.reason, error.retry_after, error.headers["x-ratelimit-remaining-requests"]) == (
        "requests_per_minute", 30.0, "0")  # fmt: skip
    http = to_http(error)
    assert (http.status, http.body["error"]["type"], http.body["error"]["code"]) == (429, "rate_limit_error",
                                                                                   "rate_limit_exceeded")  # fmt: skip
    assert http.headers["Retry-After"] == "30" and http.headers["x-ratelimit-reset-requests"] == "1m0s"
    clock.now += 30  # half a minute: one request back
    assert quotas.acquire(tenant, 10, 10).headers["x-ratelimit-remaining-requests"] == "0"
    refusal(quotas, tenant)


def test_tokens_per_minute_count_prompt_and_max_tokens_and_unused_tokens_come_back():
    clock = Clock()
    quotas, tenant = Quotas(clock), Tenant("a", quotas=Limits(tokens_per_minute=100))
    lease = quotas.acquire(tenant, 30, 50)
    assert lease.headers["x-ratelimit-remaining-tokens"] == "20"
    error = refusal(quotas, tenant, 10, 20)
    assert error.reason == "tokens_per_minute" and error.retry_after == pytest.approx(6.0)
    quotas.release(lease, 30 + 5)  # it generated 5 of its 50
    assert quotas.acquire(tenant, 10, 20).headers["x-ratelimit-remaining-tokens"] == "35"
    too_large = refusal(quotas, tenant, 60, 50)
    assert too_large.retry_after is None and "too large" in str(too_large)


def test_concurrency_and_prompt_length():
    quotas = Quotas(Clock())
    tenant = Tenant("a", quotas=Limits(max_concurrent=1, max_prompt_tokens=100))
    lease = quotas.acquire(tenant, 100, 10)
    assert refusal(quotas, tenant).reason == "max_concurrent"
    quotas.release(lease, 0)
    assert quotas.in_flight("a") == 0
    long = refusal(quotas, tenant, 101, 10)
    assert long.reason == "max_prompt_tokens" and to_http(long).status == 429
    quotas.acquire(tenant, 100, 10)


def test_a_refusal_takes_nothing_and_tenants_do_not_share_quotas():
    quotas = Quotas(Clock())
    limits = Limits(requests_per_minute=1, tokens_per_minute=100)
    a, b = Tenant("a", quotas=limits), Tenant("b", quotas=limits)
    quotas.acquire(a, 10, 10)
    refusal(quotas, a)
    assert refusal(quotas, a).headers["x-ratelimit-remaining-tokens"] == "80"  # the refused ones took no tokens
    quotas.acquire(b, 10, 10)


def test_a_tenant_without_quotas_is_never_refused_and_gets_no_headers():
    quotas = Quotas(Clock())
    for _ in range(1000):
        assert quotas.acquire(Tenant("free"), 10_000, 10_000).headers == {}
