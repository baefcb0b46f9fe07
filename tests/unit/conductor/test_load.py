"""The conductor's predicted load: the prefill queue chain and the decode batch forecast."""

import pytest

from services.conductor.load import DecodeLoad, PrefillLoad


def test_the_prefill_queue_chains_and_resets_at_each_first_token():
    q = PrefillLoad()
    assert q.add("a", 1.0, now=10.0) == 11.0
    assert q.add("b", 2.0, now=10.5) == 13.0
    assert q.backlog(10.5) == 2.5
    assert q.done("a", now=12.0)  # late: "b" starts now
    assert q.busy_until == 14.0
    assert not q.done("a", now=12.0)
    q.clear(now=12.5)
    assert (q.num_pending, q.backlog(12.5)) == (0, 0.0)


def test_the_decode_batch_now_later_and_its_expected_ends():
    d = DecodeLoad()
    d.add("a", 100, start=0.0, tokens=10, expected=10)
    d.add("b", 50, start=5.0, tokens=100, expected=20)  # still in prefill
    d.started("a", now=1.0)
    assert d.current(now=2.0, step_s=0.1) == (1, 100 + 10)
    assert d.total(now=2.0, step_s=0.1) == (2, 100 + 10 + 50)
    assert d.forecast(at=1.5, now=1.0, step_s=0.1) == (2, 105 + 50)  # "a" until 2.0, "b" is on its way
    assert d.forecast(at=2.5, now=1.0, step_s=0.1) == (1, 50)  # "a" is done by then
    assert d.expected_ends(now=1.0, step_s=0.1) == pytest.approx([2.0, 7.0])
    assert d.done("a") and not d.done("a")
    assert d.current(now=2.0, step_s=0.1) == (0, 0)


def test_a_prefill_reports_its_service_time_and_an_overdue_one_keeps_the_queue_behind_it():
    q = PrefillLoad()
    q.add("a", 1.5, now=0.0, speed=1.5)  # the cost model said 1.0 s; this instance runs 1.5x slower
    q.add("b", 3.0, now=0.5, speed=1.5)
    assert q.busy_until == 4.5
    assert q.backlog(now=6.0) == 3.0  # "a" is overdue: "b" has not started, so its 3 s are still ahead
    served = q.done("a", now=7.0)
    assert (served.predicted_s, served.measured_s) == (1.0, 7.0)  # from when "a" started
    q.add("c", 1.0, now=7.5)
    assert q.done("c", now=8.0).measured_s is None  # out of order: when it started is unknown
    assert q.done("b", now=9.0).measured_s == 2.0  # "b" started when "a" ended
