"""Overload: a long prompt's TTFT counts the shorter prompts that will go first, and a
guard stops that preference before a band is starved."""

import random

import pytest

from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from services.conductor.overload import DECISIONS, MAX_SHARE, MIN_SPAN_S, WINDOW_S, Overload, OverloadConfig
from tests.unit.conductor.helpers import beat, cluster, config, request


def test_the_share_shorter_prompts_take_counts_only_admitted_shorter_work_in_the_window():
    o = Overload()
    o.observe(now=0.0, num_prompt_tokens=50, work_s=6.0, admitted=True)  # band <128
    o.observe(now=10.0, num_prompt_tokens=300, work_s=3.0, admitted=True)  # band 128-511
    o.observe(now=10.0, num_prompt_tokens=40, work_s=9.0, admitted=False)  # refused: takes nothing
    o.observe(now=10.0, num_prompt_tokens=140, work_s=1.0, admitted=True)  # band 128-511
    assert o.shorter_share(300, now=10.0, num_instances=1) == pytest.approx(7.0 / 10.0)  # the same band counts
    assert o.shorter_share(140, now=10.0, num_instances=1) == pytest.approx(6.0 / 10.0)  # as long: shorter only
    assert o.shorter_share(400, now=10.0, num_instances=2) == pytest.approx(10.0 / 20.0)
    # the shortest band is never held back, though shorter prompts of it were admitted
    assert o.shorter_share(60, now=10.0, num_instances=1) == o.shorter_share(127, now=10.0, num_instances=1) == 0.0
    # 10 s since the first admission: that is all the load seen so far (10 s of it, 1.0: at most 0.75)
    assert o.shorter_share(1500, now=10.0, num_instances=1) == MAX_SHARE
    assert o.shorter_share(1500, now=10.0, num_instances=4) == pytest.approx(10.0 / 40.0)
    assert o.shorter_share(140, now=20.0, num_instances=1) == pytest.approx(6.0 / 20.0)
    assert o.shorter_share(1500, now=WINDOW_S, num_instances=1) == pytest.approx(10.0 / WINDOW_S)  # a full window
    assert o.shorter_share(140, now=WINDOW_S + 1, num_instances=1) == 0.0  # the short one left the window


def test_a_conductor_that_just_started_takes_the_load_over_the_time_it_has_seen():
    o = Overload()
    o.observe(now=100.0, num_prompt_tokens=50, work_s=0.25, admitted=True)
    assert o.shorter_share(300, now=100.2, num_instances=1) == pytest.approx(0.25 / MIN_SPAN_S)  # not under 5 s
    o.observe(now=106.5, num_prompt_tokens=50, work_s=0.5, admitted=True)
    assert o.shorter_share(300, now=108.0, num_instances=1) == pytest.approx(0.75 / 8.0)  # nor over 30 s


def test_a_burst_of_shorter_prompts_never_makes_a_longer_one_unable_to_start():
    o = Overload()
    for i in range(40):  # 40 short prompts at once, 0.5 s of work each: 20 s of work in no time
        o.observe(now=0.0, num_prompt_tokens=20 + i, work_s=0.5, admitted=True)
    assert o.shorter_share(1000, now=0.0, num_instances=1) == MAX_SHARE < 1  # its TTFT x 4, not infinite


def test_a_band_refused_far_more_often_than_all_is_no_longer_held_back():
    o = Overload(OverloadConfig(max_refusal_ratio=3.0))
    for _ in range(40):
        o.observe(0.0, 50, 1.0, admitted=True)
    for i in range(10):
        o.observe(0.0, 1500, 1.0, admitted=i < 8)  # 20% of long ones refused, 4% overall: 20% > 12%
    assert o.guarded(3) and o.shorter_share(1500, now=0.0, num_instances=1) == 0.0
    assert o.refusal_rates() == {"<128": 0.0, ">=1024": pytest.approx(0.2)}
    assert OverloadConfig(max_refusal_ratio=0.0) != o.config
    off = Overload(OverloadConfig(max_refusal_ratio=0.0))
    off.observe(0.0, 50, 5.0, admitted=True)
    assert off.shorter_share(1500, now=0.0, num_instances=1) == 0.0


def test_under_a_stream_of_short_prompts_a_long_one_is_refused_for_the_time_they_will_take():
    beats = (beat("p0", "prefill"), beat("d0", "decode"))
    view, index, clock = cluster(*beats)
    s = Admitter(build_policy("cache_aware+predictive_rejection"), view, index, config(2.0, 10.0))

    def at(now: float) -> None:
        clock.now = now
        for hb in beats:
            view.observe(hb)

    def short(i: int) -> None:  # a 0.1 s prompt, served as predicted
        at(i * 0.1)
        assert s.admit(request(f"s{i}", tokens=100, blocks=[])).admitted
        at(i * 0.1 + 0.1)
        s.first_token(f"s{i}")
        s.finished(f"s{i}")

    for i in range(20):  # 20 prompts of 0.1 s admitted in 2 s
        short(i)
    # 1.2 s alone, on an idle instance; 2 s of 30 taken by shorter ones: 1.29 s, fits
    assert s.admit(request("long", tokens=1200, blocks=[])).admitted
    at(3.2)
    s.first_token("long")
    s.finished("long")
    for i in range(32, 250):  # much more short work: the instance is all but full of it
        short(i)
    # on an idle instance a prompt that can meet its target alone is admitted all the same (never refused idle)
    assert s.admit(request("idle", tokens=1500, blocks=[], max_tokens=1)).admitted
    at(clock.now + 1.6)
    s.first_token("idle")
    s.finished("idle")
    assert s.admit(request("busy", tokens=100, blocks=[])).admitted  # one short prompt queued
    refused = s.admit(request("long2", tokens=1500, blocks=[]))
    assert (refused.admitted, refused.reason) == (False, "ttft_slo"), refused
    assert "shorter prompts" in refused.error_message


def test_the_refusal_rates_cover_only_the_most_recent_decisions():
    """The counts kept as decisions come and go equal the rates over the window they
    are taken over, once older decisions fall out of it."""
    rng = random.Random(4)
    o, seen = Overload(), []
    for i in range(3 * DECISIONS):
        tokens, admitted = rng.choice([50, 300, 700, 1500]), rng.random() < (0.9 if i < DECISIONS else 0.4)
        o.observe(0.0, tokens, 1.0, admitted)
        seen.append((tokens, not admitted))
    recent = seen[-DECISIONS:]
    for band, edge in enumerate([50, 300, 700, 1500]):
        mine = [refused for tokens, refused in recent if tokens == edge]
        assert o.refusal_rates()[["<128", "128-511", "512-1023", ">=1024"][band]] == pytest.approx(sum(mine) / len(mine))
        overall = sum(refused for _, refused in recent) / len(recent)
        assert o.guarded(band) == (sum(mine) / len(mine) > max(0.10, 3.0 * overall))
