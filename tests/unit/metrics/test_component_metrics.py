"""What the workers, the store and the conductor put in the scrape, read from the
state they keep, with exact values."""

from collections import Counter
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from libs.common.metrics import Metrics
from libs.engine.model.block_pool import BlockPool
from libs.engine.worker_metrics import WorkerMetrics
from services.conductor.admitter import TBT_ERROR_BUCKETS, PredictionErrors
from services.conductor.conductor_metrics import ConductorMetrics
from services.conductor.routers import Decision
from services.store.store_metrics import declare_store_metrics
from services.store.tier import TierStats


def scrape(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    """name and own labels (the identity ones left out) -> value."""
    identity = {"instance", "role", "model_name"}
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k not in identity)): s.value
            for f in text_string_to_metric_families(metrics.exposition()) for s in f.samples}  # fmt: skip


def test_a_worker_reports_its_queue_its_kv_usage_and_its_prefix_cache_in_tokens():
    pool, queue = BlockPool(8), {"running": 3, "waiting": 2}
    m = Metrics("prefill-0", "prefill", "M")
    w = WorkerMetrics(m, pool, lambda: queue["running"], lambda: queue["waiting"])
    pool.allocate(2)
    w.prefix_lookup(100, {"device": 32, "dram": 16, "disk": 0})
    w.prefix_lookup(50, {"device": 16})
    found = scrape(m)
    assert found[("kvserve_num_requests_running", frozenset())] == 3
    assert found[("kvserve_num_requests_waiting", frozenset())] == 2
    assert found[("kvserve_kv_cache_usage_ratio", frozenset())] == 0.25
    assert found[("kvserve_prefix_cache_queries_total", frozenset())] == 150
    hits = {dict(labels)["tier"]: v for (name, labels), v in found.items() if name == "kvserve_prefix_cache_hits_total"}
    assert hits == {"device": 48, "peer": 0, "dram": 16, "disk": 0}


class FakeTier:
    def __init__(self, name: str, blocks: int, block_bytes: int, capacity: int) -> None:
        self.name, self.blocks, self.block_bytes, self.capacity = name, blocks, block_bytes, capacity

    def stats(self) -> TierStats:
        return TierStats(self.blocks, self.blocks * self.block_bytes, self.capacity)


def test_the_store_reports_each_tier_and_its_tallies():
    dram, disk = FakeTier("dram", 3, 100, 1000), FakeTier("disk", 7, 100, 10_000)
    counters = Counter({"hits_dram": 5, "hits_disk": 2, "misses": 4, "evicted_dram": 1, "demoted": 2,
                        "evicted_disk": 3, "corrupt_blocks": 1, "promotions": 2, "written_behind": 6})  # fmt: skip
    tiers = SimpleNamespace(tiers=[dram, disk], counters=counters, num_unwritten=9)
    m = Metrics("store-0", "store", "M")
    declare_store_metrics(m, tiers)
    dram.blocks = 4  # read when scraped
    found = scrape(m)

    def by_tier(name):
        return {dict(labels)["tier"]: v for (n, labels), v in found.items() if n == name}

    assert by_tier("kvserve_store_blocks") == {"dram": 4, "disk": 7}
    assert by_tier("kvserve_store_used_bytes") == {"dram": 400, "disk": 700}
    assert by_tier("kvserve_store_capacity_bytes") == {"dram": 1000, "disk": 10_000}
    assert by_tier("kvserve_store_hits_total") == {"dram": 5, "disk": 2}
    assert by_tier("kvserve_store_evictions_total") == {"dram": 3, "disk": 3}  # from DRAM: evicted or demoted
    assert found[("kvserve_store_misses_total", frozenset())] == 4
    assert found[("kvserve_store_checksum_failures_total", frozenset())] == 1
    assert found[("kvserve_store_write_behind_pending_blocks", frozenset())] == 9


def test_the_conductor_reports_admissions_rejections_and_its_prediction_error():
    errors = PredictionErrors()
    for e in (-0.3, 0.02, 0.7):
        errors.observe(e)
    tbt_errors = PredictionErrors(TBT_ERROR_BUCKETS, "TBT")
    tbt_errors.observe(0.004)
    scheduler = SimpleNamespace(num_admitted=3, rejections={"ttft_slo": 2, "no_prefill": 1}, errors=errors,
                                tbt_errors=tbt_errors, admitted={}, num_own=0)  # fmt: skip
    m = Metrics("conductor-0", "conductor", "M")
    c = ConductorMetrics(m, scheduler, SimpleNamespace(num_blocks=12), SimpleNamespace(gaps=1))
    decision = c.timed(lambda: Decision(prefill_id="p", decode_id="d"))
    assert decision.prefill_id == "p" and c.decision_seconds.value() == 1
    found = scrape(m)
    rejected = {dict(labels)["reason"]: v for (n, labels), v in found.items() if n == "kvserve_requests_rejected_total"}
    assert rejected == {"ttft_slo": 2, "tbt_slo": 0, "decode_full": 0, "fair_share": 0, "no_prefill": 1}
    assert found[("kvserve_requests_admitted_total", frozenset())] == 3
    assert found[("kvserve_conductor_kv_index_blocks", frozenset())] == 12
    assert found[("kvserve_conductor_ttft_prediction_error_seconds_count", frozenset())] == 3
    assert abs(found[("kvserve_conductor_ttft_prediction_error_seconds_sum", frozenset())] - 0.42) < 1e-9
    assert found[("kvserve_conductor_ttft_prediction_error_seconds_bucket", frozenset({("le", "0.0")}))] == 1
    assert found[("kvserve_conductor_ttft_prediction_error_seconds_bucket", frozenset({("le", "+Inf")}))] == 3
    assert abs(found[("kvserve_conductor_ttft_prediction_abs_error_seconds_total", frozenset())] - 1.02) < 1e-9
    assert found[("kvserve_conductor_tbt_prediction_error_seconds_bucket", frozenset({("le", "0.005")}))] == 1
    assert found[("kvserve_conductor_tbt_prediction_error_seconds_bucket", frozenset({("le", "0.0")}))] == 0
