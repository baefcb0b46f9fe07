"""Goodput, SLO attainment and percentiles on hand-built records: exact values."""

import pytest

from kvserve.replay.metrics import SLO, goodput_at_attainment, summarize
from kvserve.replay.records import RequestRecord, Run


def ok(index, ttft, e2e, output_tokens, itl=(), cached=0, expected_blocks=0) -> RequestRecord:
    return RequestRecord(
        index=index, scheduled_s=float(index), input_tokens=64, max_tokens=output_tokens, status="ok",
        http_status=200, ttft_s=ttft, e2e_s=e2e, output_tokens=output_tokens, itl_s=list(itl),
        cached_tokens=cached, cached_blocks_expected=expected_blocks,
    )  # fmt: skip


def run_of(records, duration=10.0, scale=1.0) -> Run:
    return Run("r", "http://x", scale, duration, records, {"block_tokens": 16})


SLO_1S_100MS = SLO(ttft_ms=1000, tpot_ms=100)


def test_goodput_and_attainment_follow_vllm_definitions():
    records = [
        ok(0, ttft=0.5, e2e=1.4, output_tokens=10),  # tpot 0.1: on both limits, inclusive -> good
        ok(1, ttft=1.0, e2e=1.0, output_tokens=1),  # one token: tpot 0 -> good
        ok(2, ttft=1.001, e2e=1.5, output_tokens=5),  # ttft over
        ok(3, ttft=0.2, e2e=2.2, output_tokens=11),  # tpot 0.2 over
        RequestRecord(4, 4.0, 64, 8, status="rejected", http_status=429),
        RequestRecord(5, 5.0, 64, 8, status="error", http_status=500),
    ]
    s = summarize(run_of(records, duration=8.0), SLO_1S_100MS)
    assert (s.requests, s.completed, s.rejected, s.errors, s.good) == (6, 4, 1, 1, 2)
    assert s.slo_attainment == 2 / 6
    assert s.goodput_rps == 2 / 8.0
    assert s.throughput_rps == 4 / 8.0
    assert s.output_tokens_per_s == 27 / 8.0
    assert s.offered_rps == 5 / 5.0  # 6 arrivals over 5 s


def test_tpot_percentiles_leave_out_one_token_answers():
    records = [ok(0, 0.1, 1.1, 11), ok(1, 0.1, 0.1, 1), ok(2, 0.1, 2.1, 11)]
    s = summarize(run_of(records), SLO_1S_100MS)
    assert s.tpot.count == 2
    assert s.tpot.mean == pytest.approx(150.0)
    assert s.ttft.count == 3 and s.ttft.p50 == pytest.approx(100.0)


def test_percentiles_and_pooled_itl():
    records = [ok(i, ttft=(i + 1) / 100, e2e=1.0, output_tokens=3, itl=(0.01 * (i + 1), 0.02)) for i in range(100)]
    s = summarize(run_of(records), SLO_1S_100MS)
    assert s.ttft.p50 == pytest.approx(505.0)  # numpy's linear interpolation over 10..1000 ms
    assert s.ttft.p90 == pytest.approx(901.0)
    assert s.ttft.p99 == pytest.approx(990.1)
    assert s.itl.count == 200
    assert s.e2e.p99 == pytest.approx(1000.0)


def test_cached_tokens_are_summed_over_completed_requests():
    records = [ok(0, 0.1, 0.2, 2, cached=32, expected_blocks=2), ok(1, 0.1, 0.2, 2, cached=0, expected_blocks=1)]
    records.append(RequestRecord(2, 2.0, 64, 8, status="rejected", cached_blocks_expected=4))
    s = summarize(run_of(records), SLO_1S_100MS)
    assert (s.prompt_tokens, s.cached_tokens, s.cacheable_tokens) == (128, 32, 48)


def test_goodput_at_attainment_picks_the_best_passing_load():
    def summary(scale, good, n=10, duration=10.0):
        records = [ok(i, 0.1, 0.2, 2) for i in range(good)]
        records += [RequestRecord(i, float(i), 64, 2, status="rejected") for i in range(good, n)]
        return summarize(run_of(records, duration, scale), SLO_1S_100MS)

    light, medium, heavy = summary(1.0, 10, duration=20.0), summary(0.5, 9), summary(0.25, 8, duration=5.0)
    assert goodput_at_attainment([light, medium, heavy], 0.9) is medium  # 0.9 req/s beats 0.5; heavy fails 90%
    assert goodput_at_attainment([heavy], 0.9) is None
