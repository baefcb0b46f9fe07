"""The conductor's predicted load: the prefill queue chain and the decode batch forecast."""

import pytest

from services.conductor.load import DecodeLoad, PrefillLoad


def test_the_prefill_order_puts_short_work_first_and_the_running_chunk_is_not_cut():
    q = PrefillLoad()
    q.chunk_s = 0.25
    q.add("long", 1.5, now=0.0, deadline=2.0)
    q.add("short", 0.1, now=0.1, deadline=2.1)
    assert q.backlog(0.1) == pytest.approx(1.5)  # "long" ran 0.1 s, "short" not yet
    # a new 0.2 s job waits for the chunk in progress and for "short" (shorter than it), not for "long"
    assert q.wait(0.2, now=0.1) == pytest.approx(0.15 + 0.1)
    assert q.wait(0.2, now=0.1, deadline=None) == pytest.approx(1.5)  # best effort: behind everything
    assert q.imposed(0.2, now=0.1) == pytest.approx(0.2)  # it delays "long" by its own time
    placed = q.place("new", 0.2, now=0.1, deadline=2.1)
    assert placed.done_at == pytest.approx(0.1 + 0.15 + 0.1 + 0.2) and placed.breaks == ()
    # a 0.6 s job cannot fit: before "long" it makes it late, after it, itself
    late = q.place("big", 0.6, now=0.1, deadline=2.1)
    assert late.breaks == ("long",)  # it could only go first: refused for breaking the promise
    assert q.done("short", now=0.5) is not None and q.done("short", now=0.5) is None
    q.clear(now=1.0)
    assert (q.num_pending, q.backlog(1.0)) == (0, 0.0)


def test_an_instance_is_about_idle_when_what_is_booked_ends_within_a_chunk():
    q = PrefillLoad()
    assert q.about_idle(0.0)  # empty
    q.add("a", 0.6, now=0.0, deadline=2.0)
    assert not q.about_idle(0.0)  # without chunks, only an empty instance is
    q.chunk_s = 0.25
    assert not q.about_idle(0.1)  # 0.5 s left: more than a chunk
    assert q.about_idle(0.4)  # 0.2 s left
    assert q.about_idle(0.7) and q.num_pending == 1  # done by the plan, its first token on its way
    q.add("b", 0.3, now=0.7, deadline=2.7)
    assert not q.about_idle(0.7)


def test_a_placement_names_the_promises_it_would_break():
    q = PrefillLoad()  # chunk_s None: a running job is never cut
    q.add("a", 1.0, now=0.0, deadline=1.0)
    q.add("b", 0.5, now=0.0, deadline=1.6)  # "a" runs first (it would miss otherwise), then "b"
    placed = q.place("c", 0.3, now=0.0, deadline=1.3)  # c before b: b ends at 1.8 > 1.6
    assert placed.breaks == ("b",) or placed.done_at > 1.3


def test_a_heartbeats_progress_sets_the_plan_right():
    q = PrefillLoad()
    q.add("a", 1.0, now=0.0, deadline=5.0)
    q.add("b", 2.0, now=0.0, deadline=5.0)
    # the plan ran "a" first and thinks it done by 1.5; the instance says it has half of "a" left
    assert q.backlog(1.5) == pytest.approx(1.5)
    q.sync({"a": 0.5, "b": 1.0}, now=1.5)
    assert q.backlog(1.5) == pytest.approx(0.5 + 2.0)
    assert q.wait(0.6, now=1.5) == pytest.approx(0.5)  # "a" is in progress: a newcomer waits for it


def test_a_prefill_alone_reports_its_service_time():
    q = PrefillLoad()
    q.add("a", 1.5, now=0.0, speed=1.5, deadline=5.0)  # the cost model said 1.0 s; this instance runs 1.5x slower
    served = q.done("a", now=2.0)
    assert (served.predicted_s, served.measured_s) == (1.0, 2.0)
    q.add("b", 1.0, now=3.0, deadline=5.0)
    q.add("c", 1.0, now=3.5, deadline=5.0)
    assert q.done("b", now=4.0).measured_s is None  # "c" shared the instance meanwhile


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




def test_a_favored_job_goes_before_the_others_and_only_the_favored_hold_it_to_their_promises():
    from libs.common.prefill_order import Work, plan

    jobs = [Work("short", 0.1, 5.0), Work("favored", 0.8, 5.0, favored=True), Work("late", 0.1, 0.05),
            Work("late-favored", 0.5, 0.05, favored=True), Work("effort", 0.1, None)]  # fmt: skip
    assert [w.key for w in plan(jobs, now=0.0)] == ["favored", "short", "late-favored", "late", "effort"]
    q = PrefillLoad()  # chunk_s None: a running job is never cut
    q.add("running", 0.2, now=0.0, deadline=2.0)
    q.add("a1", 0.5, now=0.0, deadline=0.8)  # another tenant's, promised: due at 0.8, done at 0.7
    placed = q.place("b1", 0.6, now=0.0, deadline=2.0, favored=True)
    assert placed.done_at == pytest.approx(0.2 + 0.6)  # after the running job, before a1
    assert placed.breaks == ()  # a1 is late now (1.3 > 0.8), but it is not favored
    # unfavored, a job that can only be on time by going first breaks a1's promise
    assert q.place("b2", 0.3, now=0.0, deadline=0.6).breaks == ("a1",)
    q.add("b1", 0.6, now=0.0, deadline=0.9, favored=True)
    assert q.place("b3", 0.3, now=0.0, deadline=0.6, favored=True).breaks == ("b1",)  # favored hold favored
