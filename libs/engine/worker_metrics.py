"""What a prefill or decode worker reports of its engine, as vLLM's engine does:
requests running and waiting, how full its KV pool is, and its prefix cache's
queries and hits per tier, in tokens.

Gauges are read when scraped (on the event loop, which reads the pool's counts; the
engine thread changes them by whole operations). The prefix cache is counted by the
worker as it attaches a request's prefix: `prefix_lookup` once per prompt."""

from collections.abc import Callable, Mapping

from libs.common.metrics import Metrics
from libs.engine.model.block_pool import BlockPool
from libs.protocol.vocabulary import KVTier


class WorkerMetrics:
    def __init__(
        self, metrics: Metrics, pool: BlockPool, num_running: Callable[[], int], num_waiting: Callable[[], int]
    ) -> None:
        m = metrics
        m.gauge("kvserve_num_requests_running", "Requests this worker is computing now").set_function(num_running)
        m.gauge("kvserve_num_requests_waiting", "Requests waiting in this worker's queue").set_function(num_waiting)
        m.gauge("kvserve_kv_cache_usage_ratio",
                "Fraction of this worker's KV blocks in use (1: full)").set_function(lambda: _usage(pool))  # fmt: skip
        m.gauge("kvserve_kv_cache_blocks", "KV blocks in this worker's pool").set(pool.num_blocks)
        self.queries = m.counter("kvserve_prefix_cache_queries_total",
                                 "Prompt tokens looked up in the prefix cache (tokens, not blocks)")  # fmt: skip
        self.hits = m.counter("kvserve_prefix_cache_hits_total",
                              "Prompt tokens whose KV was reused rather than computed, by where it came from: "
                              "device (this worker's own pool), peer (another worker's), dram or disk (a store); "
                              "tokens, not blocks", ["tier"], list(KVTier))  # fmt: skip

    def prefix_lookup(self, num_prompt_tokens: int, hits: Mapping[str, int]) -> None:
        """A prompt of ``num_prompt_tokens`` was looked up; ``hits``: tokens reused, by tier."""
        self.queries.inc(num_prompt_tokens)
        for tier, tokens in hits.items():
            if tokens:
                self.hits.labels(tier).inc(tokens)


def _usage(pool: BlockPool) -> float:
    return 1.0 - pool.num_free_blocks / pool.num_blocks if pool.num_blocks else 0.0
