"""Each tenant's quotas (requests and tokens per minute, concurrent requests,
prompt length), checked when a request is prepared and before it is admitted.

A per-minute limit is a token bucket holding a minute's worth and refilling
continuously, as OpenAI's limits behave: ``remaining`` is what the bucket holds,
``reset`` the time until it is full again. A request takes its prompt tokens and
its max_tokens up front and gets back what it did not use when it ends (all of
it when it never ran). A refusal is `QuotaExceededError` (429, reason: the quota)
with OpenAI's x-ratelimit-* headers; an admitted request carries them too.
The limits are read from the tenant at every check, so a reloaded file applies at once.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.common.tenants import Tenant
from services.gateway.errors import QuotaExceededError

WINDOW_S = 60.0


@dataclass
class Bucket:
    level: float | None = None  # None: full (not drawn from yet)
    updated: float = 0.0

    def refill(self, capacity: int, now: float) -> float:
        if self.level is None:
            level = float(capacity)
        else:
            level = min(capacity, self.level + (now - self.updated) * capacity / WINDOW_S)
        self.level, self.updated = level, now
        return level

    def reset_in(self, capacity: int) -> float:
        """Seconds until the bucket is full again (call after `refill`)."""
        return max(0.0, (capacity - (self.level or 0.0)) * WINDOW_S / capacity)

    def wait_for(self, capacity: int, amount: float) -> float:
        """Seconds until it holds ``amount`` (call after `refill`)."""
        return max(0.0, (amount - (self.level or 0.0)) * WINDOW_S / capacity)


@dataclass
class TenantState:
    requests: Bucket = field(default_factory=Bucket)
    tokens: Bucket = field(default_factory=Bucket)
    in_flight: int = 0


@dataclass
class QuotaLease:
    """One admitted request's hold on its tenant's quotas: give it back with `Quotas.release`."""

    tenant: Tenant
    tokens: int  # taken from the tokens bucket
    headers: dict[str, str]  # the x-ratelimit-* headers of its answer


class Quotas:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._states: dict[str, TenantState] = {}

    def acquire(self, tenant: Tenant, num_prompt_tokens: int, max_tokens: int) -> QuotaLease:
        """Take one request of ``num_prompt_tokens`` + ``max_tokens`` from ``tenant``'s
        quotas; raise QuotaExceededError (nothing taken) when one is exhausted."""
        q, now = tenant.quotas, self.clock()
        state = self._states.setdefault(tenant.name, TenantState())
        cost = num_prompt_tokens + max_tokens
        if q.requests_per_minute is not None:
            state.requests.refill(q.requests_per_minute, now)
        if q.tokens_per_minute is not None:
            state.tokens.refill(q.tokens_per_minute, now)
        if q.max_prompt_tokens is not None and num_prompt_tokens > q.max_prompt_tokens:
            self._refuse(tenant, state, "max_prompt_tokens", None,
                         f"The prompt has {num_prompt_tokens} tokens; this tenant's limit is {q.max_prompt_tokens}.")
        if q.max_concurrent is not None and state.in_flight >= q.max_concurrent:
            self._refuse(tenant, state, "max_concurrent", 1.0,
                         f"Rate limit reached: {q.max_concurrent} concurrent requests for this tenant.")
        if q.requests_per_minute is not None and state.requests.level < 1:
            wait = state.requests.wait_for(q.requests_per_minute, 1)
            self._refuse(tenant, state, "requests_per_minute", wait,
                         f"Rate limit reached for requests per min (RPM): limit {q.requests_per_minute}. "
                         f"Please try again in {_duration(wait)}.")  # fmt: skip
        if q.tokens_per_minute is not None:
            if cost > q.tokens_per_minute:
                self._refuse(tenant, state, "tokens_per_minute", None,
                             f"Request too large for tokens per min (TPM): limit {q.tokens_per_minute}, requested "
                             f"{cost} (prompt and max_tokens).")  # fmt: skip
            if state.tokens.level < cost:
                wait = state.tokens.wait_for(q.tokens_per_minute, cost)
                self._refuse(tenant, state, "tokens_per_minute", wait,
                             f"Rate limit reached for tokens per min (TPM): limit {q.tokens_per_minute}, used "
                             f"{q.tokens_per_minute - math.floor(state.tokens.level)}, requested {cost}. "
                             f"Please try again in {_duration(wait)}.")  # fmt: skip
        if q.requests_per_minute is not None:
            state.requests.level -= 1
        if q.tokens_per_minute is not None:
            state.tokens.level -= cost
        state.in_flight += 1
        return QuotaLease(tenant, cost if q.tokens_per_minute is not None else 0, self._headers(tenant, state))

    def release(self, lease: QuotaLease, used_tokens: int) -> None:
        """The request is over, having used ``used_tokens`` of the tokens it took: the rest go back."""
        state = self._states[lease.tenant.name]
        state.in_flight -= 1
        if lease.tokens and state.tokens.level is not None:
            state.tokens.level += max(0, lease.tokens - used_tokens)

    def in_flight(self, tenant_name: str) -> int:
        state = self._states.get(tenant_name)
        return 0 if state is None else state.in_flight

    def _refuse(self, tenant: Tenant, state: TenantState, reason: str, retry_after: float | None, message: str):
        raise QuotaExceededError(message, reason, retry_after, self._headers(tenant, state))

    def _headers(self, tenant: Tenant, state: TenantState) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the per-minute limits ``tenant`` has."""
        headers = {}
        for kind, capacity, bucket in (("requests", tenant.quotas.requests_per_minute, state.requests),
                                       ("tokens", tenant.quotas.tokens_per_minute, state.tokens)):  # fmt: skip
            if capacity is None:
                continue
            level = capacity if bucket.level is None else bucket.level
            headers[f"x-ratelimit-limit-{kind}"] = str(capacity)
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level)))
            reset = bucket.reset_in(capacity) if bucket.level is not None else 0.0
            headers[f"x-ratelimit-reset-{kind}"] = _duration(reset)
        return headers


def _duration(seconds: float) -> str:
    """OpenAI's way of writing a reset time: 20ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"
