"""Weighted fair shares under overload: when the queue builds, the tenant furthest
over its weighted share of the work in flight is refused (fair_share) and the
others are still admitted; a tenant alone may use the whole cluster."""

import pytest

from services.conductor.admission import build_policy
from services.conductor.fair_share import FairShare
from services.conductor.scheduler import Scheduler
from tests.unit.conductor.helpers import beat, cluster, config, request


def test_ratios_are_in_flight_cost_over_the_weighted_share():
    f = FairShare()
    f.add("a1", "a", 1.0, 300)
    f.add("b1", "b", 2.0, 100)
    # with a request of 200 for b: a 300, b 300 of 600; shares 200 and 400
    assert f.ratios("b", 2.0, 200) == {"a": pytest.approx(1.5), "b": pytest.approx(0.75)}
    assert f.refuses("a", 1.0, 100, pressure=0.9) == pytest.approx(400 / (500 / 3))
    assert f.refuses("b", 2.0, 100, pressure=0.9) is None  # under its share
    assert f.refuses("a", 1.0, 100, pressure=0.4) is None  # no pressure: no shares
    f.remove("b1")
    assert f.refuses("a", 1.0, 100, pressure=0.9) is None  # alone: work-conserving
    assert f.in_flight("b") == 0 and f.in_flight("a") == 300


def test_only_the_tenant_furthest_over_its_share_is_refused():
    f = FairShare()
    f.add("a", "a", 1.0, 500)
    f.add("c", "c", 1.0, 350)
    f.add("b", "b", 1.0, 50)
    assert f.refuses("a", 1.0, 10, pressure=0.9) is not None
    assert f.refuses("c", 1.0, 10, pressure=0.9) is None  # over its share, but a is further over


def flood(s: Scheduler, tenant: str, n: int, weight: float = 1.0) -> list[str | None]:
    """``n`` requests of ``tenant`` admitted or refused, none finishing: their refusal reasons."""
    reasons = []
    for i in range(n):
        d = s.admit(request(f"{tenant}{i}", tenant=tenant, tenant_weight=weight, blocks=[]))
        reasons.append(d.reason)
    return reasons


def scheduler() -> Scheduler:
    view, index, _ = cluster(beat("p0", "prefill"), beat("d0", "decode", free=10_000))
    return Scheduler(build_policy("cache_aware+early_rejection"), view, index, config(2.0, 10.0))


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
    # weight 1: over half of the work in flight after 3 of its own; weight 4: past 4/5 only after 12,
    # so the TTFT target (8 more fit) stops it first
    assert flood(light, "a", 20, weight=1.0).count(None) == 3
    heavy_reasons = flood(heavy, "a", 20, weight=4.0)
    assert heavy_reasons.count(None) == 8 and "fair_share" not in heavy_reasons


def test_finished_requests_leave_the_shares():
    s = scheduler()
    flood(s, "b", 1)
    flood(s, "a", 3)
    for i in range(3):
        s.finished(f"a{i}")
    s.finished("b0")
    assert s.fair_share.in_flight("a") == 0 and s.fair_share.in_flight("b") == 0
