"""The store's metrics, read from its tiers when scraped: what each tier holds and can
hold, hits and misses, evictions, copies up, write-behind, and checksum failures.
The tallies stay `TieredStore.counters`; this module only names them for Prometheus."""

from libs.common.metrics import Metrics
from services.store.tiers import TieredStore


def declare_store_metrics(metrics: Metrics, tiers: TieredStore) -> None:
    """Read on the event loop, as the scrape (NATS or /metrics) is served there."""
    names = [t.name for t in tiers.tiers]
    counters = tiers.counters

    def per_tier(read) -> dict[tuple[str, ...], float]:
        return {(t.name,): read(t) for t in tiers.tiers}

    metrics.gauge_function("kvserve_store_blocks", "KV blocks a store tier holds",
                           lambda: per_tier(lambda t: t.stats().num_blocks), ["tier"])  # fmt: skip
    metrics.gauge_function("kvserve_store_used_bytes", "Bytes of KV blocks a store tier holds",
                           lambda: per_tier(lambda t: t.stats().used_bytes), ["tier"])  # fmt: skip
    metrics.gauge_function("kvserve_store_capacity_bytes", "Bytes a store tier may hold",
                           lambda: per_tier(lambda t: t.stats().capacity_bytes), ["tier"])  # fmt: skip
    metrics.gauge_function("kvserve_store_write_behind_pending_blocks",
                           "Committed blocks in DRAM not yet written behind to the next tier",
                           lambda: {(): tiers.num_unwritten})  # fmt: skip
    metrics.counter_function("kvserve_store_hits_total", "Blocks a get found, by the tier that held them",
                             lambda: {(n,): counters[f"hits_{n}"] for n in names}, ["tier"])  # fmt: skip
    metrics.counter_function("kvserve_store_misses_total", "Blocks a get did not find",
                             lambda: {(): counters["misses"]})  # fmt: skip
    metrics.counter_function(
        "kvserve_store_evictions_total",
        "Blocks a tier dropped for room (from DRAM: whether or not they were written down on the way out)",
        lambda: {(n,): counters[f"evicted_{n}"] + (counters["demoted"] if n == names[0] else 0) for n in names},
        ["tier"],
    )
    metrics.counter_function("kvserve_store_promotions_total", "Blocks read up from a lower tier into DRAM",
                             lambda: {(): counters["promotions"]})  # fmt: skip
    metrics.counter_function("kvserve_store_written_behind_total", "Blocks written behind from DRAM to the next tier",
                             lambda: {(): counters["written_behind"]})  # fmt: skip
    metrics.counter_function("kvserve_store_checksum_failures_total",
                             "Blocks whose checksum failed on read (deleted and answered as a miss)",
                             lambda: {(): counters["corrupt_blocks"]})  # fmt: skip
