"""Goodput, SLO attainment and percentiles on hand-built records: exact values."""

import json

import pytest

from kvserve.replay.metrics import NEAR_IDLE_S, band_of, goodput_at_attainment, rejected_while_idle, summarize
from kvserve.replay.records import RequestRecord, Run
from libs.protocol.slo import SLO


def ok(index, ttft, e2e, output_tokens, itl=(), cached=0, expected_blocks=0) -> RequestRecord:
    return RequestRecord(
        index=index, scheduled_s=float(index), input_tokens=64, max_tokens=output_tokens, status="ok",
        http_status=200, ttft_s=ttft, e2e_s=e2e, output_tokens=output_tokens, itl_s=list(itl),
        cached_tokens=cached, cached_blocks_expected=expected_blocks,
    )  # fmt: skip


def run_of(records, duration=10.0, scale=1.0) -> Run:
    return Run("r", "http://x", scale, duration, records, {"block_tokens": 16})


SLO_1S_100MS = SLO.from_ms(1000, 100)


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


@pytest.mark.parametrize(
    "tokens, band",
    [(1, "<128"), (127, "<128"), (128, "128-511"), (511, "128-511"), (512, "512-1023"), (1023, "512-1023"),
     (1024, ">=1024"), (1972, ">=1024")],
)  # fmt: skip
def test_a_prompt_falls_in_the_band_of_its_length_as_sent(tokens, band):
    assert band_of(tokens) == band


def sized(record: RequestRecord, input_tokens: int) -> RequestRecord:
    record.input_tokens = input_tokens
    return record


def refused(index, input_tokens, start, at) -> RequestRecord:
    return RequestRecord(index, float(index), input_tokens, 8, status="rejected", http_status=429, start_s=start,
                         ended_s=at)  # fmt: skip


def test_bands_count_outcomes_and_attainment_among_all_and_among_admitted():
    records = [
        sized(ok(0, ttft=0.1, e2e=0.15, output_tokens=2), 100),  # good
        sized(ok(1, ttft=0.3, e2e=0.35, output_tokens=2), 127),  # good
        refused(2, 50, start=2.0, at=2.1),
        sized(ok(3, ttft=1.5, e2e=1.55, output_tokens=2), 128),  # ttft over
        sized(ok(4, ttft=0.2, e2e=0.25, output_tokens=2), 600),  # good
        refused(5, 1023, start=5.0, at=5.1),
        refused(6, 1500, start=6.0, at=6.1),
        RequestRecord(7, 7.0, 2000, 8, status="error", http_status=500, start_s=7.0, ended_s=7.1),
    ]
    s = summarize(run_of(records), SLO_1S_100MS)
    assert (s.good, s.rejected, s.slo_attainment, s.admitted_attainment) == (3, 3, 3 / 8, 3 / 5)
    small, medium, large, huge = s.bands
    assert [b.band for b in s.bands] == ["<128", "128-511", "512-1023", ">=1024"]
    assert (small.requests, small.completed, small.rejected, small.errors, small.good) == (3, 2, 1, 0, 2)
    assert (small.slo_attainment, small.admitted_attainment) == (2 / 3, 1.0)
    assert (small.ttft.count, small.ttft.p50, small.ttft.p99) == (2, pytest.approx(200.0), pytest.approx(298.0))
    assert (medium.requests, medium.good, medium.slo_attainment, medium.admitted_attainment) == (1, 0, 0.0, 0.0)
    assert (large.requests, large.rejected, large.good, large.slo_attainment, large.admitted_attainment) == (
        2, 1, 1, 0.5, 1.0)  # fmt: skip
    assert (huge.requests, huge.rejected, huge.errors, huge.good) == (2, 1, 1, 0)
    assert (huge.slo_attainment, huge.admitted_attainment, huge.ttft.count, huge.ttft.p50) == (0.0, 0.0, 0, None)
    json.dumps(s.to_json())  # the run file keeps it


def test_an_empty_band_has_no_ratios():
    s = summarize(run_of([sized(ok(0, ttft=0.1, e2e=0.2, output_tokens=2), 10)]), SLO_1S_100MS)
    assert [(b.requests, b.slo_attainment, b.admitted_attainment) for b in s.bands[1:]] == [(0, None, None)] * 3


def test_a_refusal_is_idle_only_when_no_other_request_awaits_its_first_token():
    records = [
        # request 0 is sent at 1.0 and has its first token at 1.5: it waits over [1.0, 1.5)
        RequestRecord(0, 0.0, 64, 4, status="ok", start_s=1.0, ttft_s=0.5, e2e_s=3.0, output_tokens=4, ended_s=4.0),
        refused(1, 64, start=1.1, at=1.2),  # request 0 awaits its first token: not idle
        refused(2, 200, start=1.5, at=1.6),  # request 0 is decoding, nothing else waits: idle
        RequestRecord(3, 0.0, 64, 4, status="error", start_s=2.0, ended_s=2.5),  # waits [2.0, 2.5), then fails
        refused(4, 1100, start=2.2, at=2.3),  # request 3 waits: not idle
        refused(5, 64, start=2.5, at=2.6),  # request 3 ended at 2.5: idle
        refused(6, 64, start=0.0, at=0.5),  # request 0 not sent yet: idle
    ]
    s = summarize(run_of(records), SLO_1S_100MS)
    assert rejected_while_idle(records) == [records[2], records[5], records[6]]
    assert s.rejected_while_idle == 3
    assert [(b.rejected, b.rejected_while_idle) for b in s.bands] == [(3, 2), (1, 1), (0, 0), (1, 0)]


def test_a_refusal_is_near_idle_when_every_request_waiting_has_its_first_token_soon_after():
    records = [
        # request 0 waits over [1.0, 1.5), request 1 over [1.2, 2.0)
        RequestRecord(0, 0.0, 64, 4, status="ok", start_s=1.0, ttft_s=0.5, e2e_s=3.0, output_tokens=4, ended_s=4.0),
        RequestRecord(1, 0.0, 64, 4, status="ok", start_s=1.2, ttft_s=0.8, e2e_s=3.0, output_tokens=4, ended_s=4.2),
        refused(2, 300, start=1.3, at=1.4),  # request 1 waits 0.6 s more: busy
        refused(3, 300, start=1.7, at=1.8),  # request 1 has its first token 0.2 s later: near idle
        refused(4, 300, start=2.0, at=2.1),  # idle
    ]
    assert rejected_while_idle(records) == [records[4]]
    assert rejected_while_idle(records, within_s=NEAR_IDLE_S) == records[3:]
    s = summarize(run_of(records), SLO_1S_100MS)
    assert (s.rejected_while_idle, s.rejected_near_idle) == (1, 2)


def test_two_refusals_at_once_do_not_make_each_other_busy():
    records = [refused(0, 64, start=1.0, at=1.2), refused(1, 64, start=1.0, at=1.2)]
    assert summarize(run_of(records), SLO_1S_100MS).rejected_while_idle == 2


def test_an_old_run_file_without_end_times_loads_and_counts_a_refusal_from_its_send(tmp_path):
    old = {
        "label": "old", "base_url": "http://x", "time_scale": 1.0, "duration_s": 2.0, "settings": {"block_tokens": 16},
        "summary": {"requests": 2},  # an older Summary's fields: ignored on load
        "requests": [
            {"index": 0, "scheduled_s": 0.0, "input_tokens": 600, "max_tokens": 2, "status": "ok", "http_status": 200,
             "start_s": 0.0, "ttft_s": 0.1, "itl_s": [0.1], "e2e_s": 0.2, "output_tokens": 2},
            {"index": 1, "scheduled_s": 0.5, "input_tokens": 64, "max_tokens": 2, "status": "rejected",
             "http_status": 429, "start_s": 0.5},
        ],
    }  # fmt: skip
    path = tmp_path / "old-x1.json"
    path.write_text(json.dumps(old))
    run = Run.load(path)
    assert run.records[1].ended_s is None and run.records[0].end_at_s == pytest.approx(0.2)
    s = summarize(run, SLO_1S_100MS)
    # the refusal came at 0.5 s, after the other request had ended: the server was idle
    assert (s.requests, s.rejected, s.good, s.admitted_attainment, s.rejected_while_idle) == (2, 1, 1, 1.0, 1)
    assert [b.rejected_while_idle for b in s.bands] == [1, 0, 0, 0]
    assert [b.requests for b in s.bands] == [1, 0, 1, 0]


def test_a_refusal_of_an_older_file_without_its_end_counts_from_its_send():
    from kvserve.replay.metrics import rejected_while_idle

    waiting = RequestRecord(0, 0.0, 64, 4, status="ok", start_s=0.0, ttft_s=2.0, e2e_s=3.0, output_tokens=4)
    busy = RequestRecord(1, 1.0, 64, 4, status="rejected", start_s=1.0)  # while "0" awaited its first token
    idle = RequestRecord(2, 5.0, 64, 4, status="rejected", start_s=5.0)
    assert (busy.end_at_s, idle.end_at_s) == (1.0, 5.0)
    assert rejected_while_idle([waiting, busy, idle]) == [idle]
