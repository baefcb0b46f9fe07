"""Weighted fair shares under overload: when the queue builds, the tenant furthest
over its weighted share of the work in flight is refused (fair_share) and the
others are still admitted; a tenant alone may use the whole cluster. On a hand-built
cluster, and in the simulator with a noisy neighbour."""

from dataclasses import replace

import pytest

from libs.engine.cost_model import CostModel, reference_coefficients
from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from services.conductor.fair_share import ACTIVE_S, USAGE_S, FairShare
from services.conductor.simulator.report import meets_slo
from services.conductor.simulator.scenarios import noisy_neighbour
from services.conductor.simulator.simulation import SimConfig, simulate
from tests.unit.conductor.helpers import beat, cluster, config, request


def test_ratios_are_usage_over_the_weighted_share():
    f = FairShare()
    f.add("a1", "a", 1.0, 300, now=0.0)
    f.add("b1", "b", 2.0, 100, now=0.0)
    # long after the admissions, usage is the work in flight: with a request of 200 for b, a 300,
    # b 300 of 600; shares 200 and 400
    later = 50 * USAGE_S
    assert f.ratios("b", 2.0, 200, now=later) == {"a": pytest.approx(1.5), "b": pytest.approx(0.75)}
    assert f.refuses("a", 1.0, 100, pressure=0.9, now=later) == pytest.approx(400 / (500 / 3))
    assert f.refuses("b", 2.0, 100, pressure=0.9, now=later) is None  # under its share
    assert f.refuses("a", 1.0, 100, pressure=0.4, now=later) is None  # no pressure: no shares
    # at once, each admission counts twice (in flight, and admitted lately): the same ratios
    assert f.ratios("b", 2.0, 400, now=0.0) == {"a": pytest.approx(1.5), "b": pytest.approx(0.75)}
    f.remove("b1")
    assert f.refuses("a", 1.0, 100, pressure=0.9, now=later) is None  # alone: work-conserving
    assert f.in_flight("b") == 0 and f.in_flight("a") == 300


def test_a_light_tenants_one_long_prompt_does_not_put_it_over_a_flooders_share():
    # a was admitted a request a second for the last 10 s (its others refused), one of them in
    # flight now; b sent one long prompt, still in flight
    f = FairShare()
    for t in range(10):
        f.add(f"a{t}", "a", 1.0, 300, now=float(t))
        if t < 9:
            f.remove(f"a{t}")
    f.add("b1", "b", 1.0, 1000, now=9.0)
    assert f.in_flight("b") > f.in_flight("a")  # by the work in flight alone, b would be the one over
    assert f.favors("b", 1.0, now=9.5) and not f.favors("a", 1.0, now=9.5)
    assert f.refuses("b", 1.0, 20, pressure=0.9, now=9.5) is None  # its next short prompt is not refused
    assert f.refuses("a", 1.0, 300, pressure=0.9, now=9.5) is not None
    # usage fades: a minute after a stopped, b's long prompt is what counts
    f.remove("a9")
    f.arrived("a", 1.0, now=60.0)
    assert f.favors("a", 1.0, now=60.0)


def test_only_the_tenant_furthest_over_its_share_is_refused():
    f = FairShare()
    f.add("a", "a", 1.0, 500)
    f.add("c", "c", 1.0, 350)
    f.add("b", "b", 1.0, 50)
    assert f.refuses("a", 1.0, 10, pressure=0.9) is not None
    assert f.refuses("c", 1.0, 10, pressure=0.9) is None  # over its share, but a is further over


def flood(s: Admitter, tenant: str, n: int, weight: float = 1.0) -> list[str | None]:
    """``n`` requests of ``tenant`` admitted or refused, none finishing: their refusal reasons."""
    reasons = []
    for i in range(n):
        d = s.admit(request(f"{tenant}{i}", tenant=tenant, tenant_weight=weight, blocks=[]))
        reasons.append(d.reason)
    return reasons


def scheduler() -> Admitter:
    view, index, _ = cluster(beat("p0", "prefill"), beat("d0", "decode", free=10_000))
    return Admitter(build_policy("cache_aware+early_rejection"), view, index, config(2.0, 10.0))


def test_a_flooding_tenant_is_refused_for_its_share_and_the_other_still_gets_in():
    s = scheduler()
    assert flood(s, "b", 1) == [None]
    reasons = flood(s, "a", 20)  # 0.17 s of prefill each: the queue builds
    admitted = reasons.count(None)
    assert reasons[admitted:] == ["fair_share"] * (20 - admitted)  # refused for its share, not yet for the SLO
    assert 0 < admitted < 11  # cut once the queue took half the TTFT target
    assert flood(s, "b", 3) == [None, None, None]  # b is under its share: still admitted, within its SLO
    assert s.rejections["fair_share"] == 20 - admitted


def test_a_tenant_alone_uses_the_whole_cluster():
    s = scheduler()
    reasons = flood(s, "a", 20)
    assert "fair_share" not in reasons
    assert reasons.count(None) == 11  # as many as the TTFT target allows, as without tenants
    assert set(reasons[11:]) == {"ttft_slo"}


def test_a_heavier_tenant_gets_more_before_it_is_refused():
    light, heavy = scheduler(), scheduler()
    flood(light, "b", 3)
    flood(heavy, "b", 3)
    # weight 1: over half of the work in flight once it has more in flight than b's 3; weight 4: past
    # 4/5 only after 12, so the TTFT target stops it first (its first requests, while b is further
    # over its share, are favored: they go before b's and fit two more than the 8 behind them)
    assert flood(light, "a", 20, weight=1.0).count(None) == 4
    heavy_reasons = flood(heavy, "a", 20, weight=4.0)
    assert heavy_reasons.count(None) == 10 and "fair_share" not in heavy_reasons


def test_finished_requests_leave_the_shares():
    s = scheduler()
    flood(s, "b", 1)
    flood(s, "a", 3)
    for i in range(3):
        s.finished(f"a{i}")
    s.finished("b0")
    assert s.fair_share.in_flight("a") == 0 and s.fair_share.in_flight("b") == 0


def test_a_tenants_first_request_is_never_refused_for_its_share():
    f = FairShare()
    f.add("a1", "a", 1.0, 100)
    assert f.refuses("b", 1.0, 1000, pressure=0.9) is None  # b has nothing in flight: not over its share yet
    f.add("b1", "b", 1.0, 1000)
    assert f.refuses("b", 1.0, 1000, pressure=0.9) is not None


def test_a_tenant_seen_recently_keeps_its_share_with_nothing_in_flight():
    f = FairShare()
    f.add("a1", "a", 1.0, 500)
    f.arrived("b", 1.0, now=100.0)  # b's requests finish fast: none in flight now
    assert f.refuses("a", 1.0, 100, pressure=0.9, now=105.0) is not None
    assert f.refuses("a", 1.0, 100, pressure=0.9, now=100.0 + ACTIVE_S + 1) is None  # b is gone: a is alone


def test_in_the_simulator_a_light_tenant_keeps_its_slo_while_another_floods():
    capacity = 1 / CostModel(reference_coefficients()).prefill_time(2048, 0)  # requests a second, one prefill
    trace = noisy_neighbour(capacity, flood=4.0, light=0.25, duration_s=60)
    config = SimConfig(1, 1, "cache_aware+predictive_rejection")

    def attainment(result, tenant: str) -> float:
        mine = [r for r in result.requests if r.trace.index in {t.index for t in trace if t.tenant == tenant}]
        return sum(meets_slo(r, config.slo) for r in mine) / len(mine)

    fair = simulate(config, trace)
    shared = simulate(config, [replace(t, tenant=None) for t in trace])  # the same requests, no tenants
    assert attainment(fair, "b") >= 0.95 > 0.5 > attainment(shared, "b")
    assert {r.reason for r in fair.requests if r.trace.tenant == "a"} >= {"fair_share"}
    alone = simulate(config, noisy_neighbour(capacity, flood=1.0, light=0.0, duration_s=60))
    assert "fair_share" not in {r.reason for r in alone.requests}  # alone, a may use all of it


def test_two_tenants_active_with_nothing_in_flight_are_over_no_share():
    # both seen lately, both requests done: a new one under pressure is judged, not a crash
    f = FairShare()
    f.arrived("a", 1.0, now=100.0)
    f.arrived("b", 1.0, now=100.0)
    assert f.ratios("a", 1.0, 0.0, now=101.0) == {"a": 0.0, "b": 0.0}
    assert f.refuses("a", 1.0, 100, pressure=0.9, now=101.0) is None  # its first in flight


def test_the_tenant_further_under_its_share_is_favored():
    f = FairShare()
    assert not f.favors("a", 1.0)  # alone
    f.add("a1", "a", 1.0, 500)
    f.add("b1", "b", 1.0, 100)
    assert f.favors("b", 1.0) and not f.favors("a", 1.0)
    assert f.favors("a", 8.0)  # weighed 8: a is under its share, b over its own


@pytest.mark.parametrize("favored", [False, True])
def test_shorter_prompts_going_first_push_back_only_an_unfavored_request(favored):
    from services.conductor.index import KVIndex
    from services.conductor.predict import AdmitContext

    view, _, clock = cluster(beat("p1", "prefill"), beat("d1", "decode", free=10_000))
    view.get("p1").prefill.add("queued", 0.5, now=clock())  # the instance is busy
    c = config()
    ctx = AdmitContext(request("r", tokens=400, blocks=[]), KVIndex().match([]), view, clock(), c.slo, c.predict,
                       prefills=view.alive("prefill"), decodes=view.alive("decode"), shorter_share=0.9,
                       favored=favored)  # fmt: skip
    decision = build_policy("cache_aware+predictive_rejection").choose(ctx)
    # 90% of the instance going to shorter prompts first would push it past its target; a favored
    # request goes before them (they are another tenant's, further over its share)
    assert decision.admitted == favored, decision.error_message


@pytest.mark.parametrize("queued_s, refused", [(0.5, True), (0.2, False)])
def test_shorter_prompts_push_back_no_request_on_an_instance_about_to_be_idle(queued_s, refused):
    from services.conductor.index import KVIndex
    from services.conductor.predict import AdmitContext

    view, _, clock = cluster(beat("p1", "prefill"), beat("d1", "decode", free=10_000))
    view.get("p1").prefill.chunk_s = 0.25
    view.get("p1").prefill.add("queued", queued_s, now=clock())
    c = config()
    ctx = AdmitContext(request("r", tokens=400, blocks=[]), KVIndex().match([]), view, clock(), c.slo, c.predict,
                       prefills=view.alive("prefill"), decodes=view.alive("decode"), shorter_share=0.9)  # fmt: skip
    decision = build_policy("cache_aware+predictive_rejection").choose(ctx)
    # with what is queued ending within a chunk, the instance is as good as idle: no shorter
    # prompt can go ahead of this one sooner than behind a job just started there
    assert decision.admitted != refused, decision.error_message
    assert refused == ("shorter prompts" in (decision.error_message or ""))


def test_a_favored_prompt_waits_for_one_short_step_and_its_own_step_carries_no_other_tenants_tokens():
    from libs.common.prefill_order import Work, plan, step

    tokens = {"a-long": 1000, "a-short": 50, "b": 40}
    flood = [Work("a-long", 2.0, 100.0, 0.0), Work("a-short", 0.1, 100.0, 1.0)]
    # a's work alone (b came lately): short steps, so a favored prompt coming next waits for at most 64 tokens
    assert step(plan(flood, 0.0), tokens.get, 256, 64, contended=True) == [("a-short", 50), ("a-long", 14)]
    # b's prompt goes first, and alone: a's tokens beside it would lengthen b's own step
    queued = plan([*flood, Work("b", 0.08, 100.0, 2.0, favored=True)], 0.0)
    assert step(queued, tokens.get, 256, 64, contended=True) == [("b", 40)]
    # nobody favored lately, or the rule off: whole steps, filled in plan order
    assert step(plan(flood, 0.0), tokens.get, 256, 64, contended=False) == [("a-short", 50), ("a-long", 206)]
    assert step(queued, tokens.get, 256, 0, contended=True) == [("b", 40), ("a-short", 50), ("a-long", 166)]


def test_in_the_simulator_a_light_tenant_waits_less_behind_the_floods_short_steps():
    capacity = 1 / CostModel(reference_coefficients()).prefill_time(2048, 0)
    trace = noisy_neighbour(capacity, flood=4.0, light=0.25, duration_s=60)
    light = {t.index for t in trace if t.tenant == "b"}

    def light_ttfts(contended_tokens: int) -> list[float]:
        result = simulate(SimConfig(1, 1, "cache_aware+predictive_rejection",
                                    prefill_contended_tokens=contended_tokens), trace)  # fmt: skip
        return sorted(r.ttft for r in result.requests if r.trace.index in light and r.ttft is not None)

    short, whole = light_ttfts(512), light_ttfts(0)
    assert len(short) >= len(whole)
    assert sum(short) / len(short) < sum(whole) / len(whole)  # simulated seconds: the waits for a's chunks
