"""The conductor's metrics, read from its scheduler, KV index and event tracker when
scraped (they keep the tallies; this module names them for Prometheus), and the time
each admission decision takes."""

import time
from collections.abc import Callable

from libs.common.kv_events import KVEventTracker
from libs.common.metrics import FAST_BUCKETS, Metrics
from services.conductor.admitter import Admitter, PredictionErrors
from services.conductor.index import KVIndex
from services.conductor.routers import Decision

# in the scrape at zero; error codes join as they occur
REJECTION_REASONS = ("ttft_slo", "tbt_slo", "decode_full", "fair_share")


class ConductorMetrics:
    def __init__(self, metrics: Metrics, scheduler: Admitter, index: KVIndex, tracker: KVEventTracker) -> None:
        m = metrics
        m.counter_function("kvserve_requests_admitted_total", "Requests the conductor admitted",
                           lambda: {(): scheduler.num_admitted})  # fmt: skip
        m.counter_function(
            "kvserve_requests_rejected_total",
            "Requests the conductor refused, by reason: a latency target predicted missed (ttft_slo, tbt_slo), "
            "no room predicted on a decode worker (decode_full), a tenant over its weighted share of a contended "
            "cluster (fair_share), or an error code such as no_prefill",
            lambda: {(r,): n for r, n in ({r: 0 for r in REJECTION_REASONS} | scheduler.rejections).items()},
            ["reason"],
        )
        declare_prediction_error(m, "kvserve_conductor_ttft_prediction_error_seconds",
                                 "kvserve_conductor_ttft_prediction_abs_error_seconds_total", "TTFT", scheduler.errors)
        declare_prediction_error(m, "kvserve_conductor_tbt_prediction_error_seconds",
                                 "kvserve_conductor_tbt_prediction_abs_error_seconds_total", "TBT", scheduler.tbt_errors)
        m.gauge_function("kvserve_conductor_kv_index_blocks", "KV blocks in the conductor's global index",
                         lambda: {(): index.num_blocks})  # fmt: skip
        m.counter_function("kvserve_conductor_kv_event_gaps_total",
                           "KV event batches found missing (each makes the conductor fetch a snapshot)",
                           lambda: {(): tracker.gaps})  # fmt: skip
        m.gauge_function("kvserve_conductor_requests_in_flight", "Admitted requests not reported finished yet",
                         lambda: {(): scheduler.num_own})  # fmt: skip
        self.decision_seconds = m.histogram("kvserve_conductor_decision_seconds",
                                            "Seconds the conductor took to decide on one request", FAST_BUCKETS)

    def timed(self, decide: Callable[[], Decision]) -> Decision:
        started = time.perf_counter()
        try:
            return decide()
        finally:
            self.decision_seconds.observe(time.perf_counter() - started)


def declare_prediction_error(m: Metrics, name: str, abs_name: str, what: str, errors: PredictionErrors) -> None:
    """A prediction's error as a histogram (signed: negative buckets are early) and the sum of its size."""
    m.histogram_function(name, f"{what} measured minus {what} predicted at admission (negative: it was faster)",
                         lambda: {(): (errors.cumulative(), errors.sum)})  # fmt: skip
    m.counter_function(abs_name, f"The sum of the absolute {what} prediction errors (over _count: the mean absolute error)",
                       lambda: {(): errors.sum_abs})  # fmt: skip
