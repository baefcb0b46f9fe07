"""Synthetic traces built to tell two policies apart, where a real trace may not:
deterministic for a seed, in the trace's 512-token blocks.

- `swinging`: bursts of requests with unrelated prompts, each far more than the
  decode instances can hold, with quiet between them. Prefills of a burst are
  in flight together, so the decode batch a request joins fills up after it is
  admitted: what plain early rejection (the batch now) cannot see and
  predictive rejection (the batch when its prefill ends) can.
- `noisy_neighbour`: two tenants, one flooding at a multiple of the cluster's
  capacity, one light: fair shares under overload keep the light one's SLOs.
- `hot_prefix`: every request starts with one of a few long shared prefixes
  (documents), the most popular far more often than the rest, at a rate no one
  instance can serve, on caches too small to hold them all: a hot prefix sits
  on a busy instance, and replication copies it to an idle peer where plain
  cache-aware routing queues behind the holder or recomputes it.
"""

import random

from services.conductor.simulator.trace import TRACE_BLOCK_SIZE, TraceRequest

_FRESH = 1_000_000  # block ids from here on are never shared


def swinging(bursts: int = 8, per_burst: int = 120, burst_s: float = 4.0, quiet_s: float = 40.0,
             prompt: tuple[int, int] = (6_000, 14_000), output: tuple[int, int] = (100, 600),
             seed: int = 0) -> list[TraceRequest]:  # fmt: skip
    rng = random.Random(seed)
    requests: list[TraceRequest] = []
    for b in range(bursts):
        start = b * (burst_s + quiet_s)
        for at in sorted(start + rng.uniform(0, burst_s) for _ in range(per_burst)):
            i = len(requests)
            n = rng.randint(*prompt)
            blocks = tuple(_FRESH + i * 1000 + k for k in range(n // TRACE_BLOCK_SIZE))
            requests.append(TraceRequest(i, at, n, rng.randint(*output), blocks))
    return requests


def hot_prefix(n: int = 1_500, rate: float = 4.0, prefixes: int = 10, prefix_blocks: int = 40,
               suffix: tuple[int, int] = (256, 2_048), unique: float = 0.0, output: tuple[int, int] = (50, 300),
               seed: int = 0) -> list[TraceRequest]:  # fmt: skip
    """``n`` requests (Poisson, ``rate`` a second), each starting with one of ``prefixes``
    shared prefixes of ``prefix_blocks`` blocks (long documents), picked with Zipf-like
    popularity (the k-th most popular 1/k as often) and followed by a prompt of its own;
    or, for a share ``unique`` of them, a prompt as long that no one shares (cache churn)."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(prefixes)]
    requests: list[TraceRequest] = []
    at = 0.0
    for i in range(n):
        at += rng.expovariate(rate)
        doc = rng.choices(range(prefixes), weights)[0]
        tail = rng.randint(*suffix)
        length = prefix_blocks * TRACE_BLOCK_SIZE + tail
        if rng.random() < unique:
            blocks = tuple(_FRESH + i * 1000 + k for k in range(length // TRACE_BLOCK_SIZE + 1))
        else:
            shared = tuple(doc * 1000 + k for k in range(prefix_blocks))
            blocks = shared + tuple(_FRESH + i * 1000 + k for k in range(tail // TRACE_BLOCK_SIZE + 1))
        requests.append(TraceRequest(i, at, length, rng.randint(*output), blocks))
    return requests


def noisy_neighbour(capacity_rps: float, flood: float = 4.0, light: float = 0.25, duration_s: float = 120.0,
                    prompt: int = 2_048, output: int = 64, seed: int = 0) -> list[TraceRequest]:  # fmt: skip
    """Two tenants with unrelated prompts (Poisson arrivals): ``a`` sends ``flood`` times the
    cluster's capacity (``capacity_rps`` requests a second), ``b`` ``light`` times it."""
    rng = random.Random(seed)
    arrivals = []
    for tenant, share in (("a", flood), ("b", light)):
        if share <= 0:
            continue
        at = rng.expovariate(capacity_rps * share)
        while at < duration_s:
            arrivals.append((at, tenant))
            at += rng.expovariate(capacity_rps * share)
    requests = []
    for i, (at, tenant) in enumerate(sorted(arrivals)):
        blocks = tuple(_FRESH + i * 1000 + k for k in range(prompt // TRACE_BLOCK_SIZE))
        requests.append(TraceRequest(i, at, prompt, output, blocks, tenant=tenant))
    return requests
