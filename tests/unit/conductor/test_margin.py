"""Admission that keeps its promise: instance speeds and safety margins learned from
observed prediction errors, and never a refusal on an idle cluster."""

import random

import pytest

from services.conductor.admission import build_policy
from services.conductor.margin import MIN_SAMPLES, MarginConfig, Margins, RatioWindow
from services.conductor.scheduler import Scheduler
from services.conductor.simulator.report import kept
from services.conductor.simulator.simulation import SimConfig, Simulation
from services.conductor.simulator.trace import TraceRequest
from tests.unit.conductor.helpers import beat, cluster, coefficients, config, request


def test_a_window_gives_its_quantile_within_bounds_and_one_while_empty():
    w = RatioWindow(size=100, quantile=0.95)
    assert w.value() == 1.0
    for i in range(100):
        w.observe(observed=1.0 + i / 100, predicted=1.0)
    assert w.value() == pytest.approx(1.95)
    w.observe(observed=1000.0, predicted=1.0)  # the oldest ratio leaves the window
    assert w.value() == pytest.approx(1.96)
    w.observe(observed=5.0, predicted=0.0)  # says nothing: ignored
    assert len(w) == 100


def test_an_instance_uses_its_own_margin_once_it_has_enough_samples_else_the_clusters():
    m = Margins()
    for _ in range(MIN_SAMPLES - 1):
        m.observe_ttft("p0", observed=3.0, predicted=1.0)
    assert m.ttft("p0") == 1.0  # too few anywhere
    m.observe_ttft("p0", observed=3.0, predicted=1.0)
    for _ in range(MIN_SAMPLES):
        m.observe_ttft("p1", observed=1.5, predicted=1.0)
    assert (m.ttft("p0"), m.ttft("p1"), m.ttft("p2")) == pytest.approx((3.0, 1.5, 3.0))


def overload(n: int = 700, seed: int = 3) -> list[TraceRequest]:
    """Unrelated prompts of 2k-9k tokens arriving faster than 2 prefill workers can serve."""
    rng = random.Random(seed)
    return [TraceRequest(i, i * 0.12, rng.randint(2000, 9000), rng.randint(20, 300), (100_000 + i,))
            for i in range(n)]  # fmt: skip


@pytest.mark.parametrize("policy", ["cache_aware+early_rejection", "cache_aware+predictive_rejection"])
def test_admission_learns_a_slow_cluster_until_it_keeps_its_promise(policy):
    # the instances run 1.5x slower than the cost model they report
    sim = Simulation(SimConfig(2, 1, policy, slowdown=1.5, store_blocks=0), overload())
    result = sim.run()
    later = result.requests[len(result.requests) // 2:]
    assert sum(r.outcome == "rejected" for r in later) > len(later) // 4  # overload: admission had to refuse
    assert kept(later, result.config.slo) >= 0.95
    margins = sim.scheduler.margins
    assert 1.35 < margins.prefill_speed("prefill-0") < 1.65  # it learned how slow the workers are
    assert margins.tbt("decode-0") > 1.3


def test_without_learning_the_same_admission_breaks_its_promise():
    sim = Simulation(SimConfig(2, 1, "cache_aware+early_rejection", slowdown=1.5, store_blocks=0), overload())
    sim.scheduler.margins = Margins(MarginConfig(window=0))  # learns nothing
    result = sim.run()
    assert kept(result.requests[len(result.requests) // 2:], result.config.slo) < 0.9


def test_an_idle_cluster_admits_what_fits_whatever_the_margins_say():
    view, index, clock = cluster(beat("p0", "prefill"), beat("d0", "decode"))
    s = Scheduler(build_policy("cache_aware+predictive_rejection"), view, index, config(ttft_s=0.2))
    for _ in range(MIN_SAMPLES):  # predictions have been 3x too optimistic
        s.margins.observe_ttft("p0", observed=3.0, predicted=1.0)
        s.margins.observe_tbt("d0", observed=3.0, predicted=1.0)
    # 170 tokens at 1 ms: 0.170 s alone, x3 = 0.51 s: over the 0.2 s target, but nothing is queued
    first = s.admit(request("a"))
    assert first.admitted and first.best_effort
    assert first.predicted_ttft_s == pytest.approx(0.170)
    second = s.admit(request("b"))  # behind it: refused, the margin applied to the queue
    assert (second.admitted, second.reason) == (False, "ttft_slo")
    assert "x margin 3.00" in second.error_message
    small = s.admit(request("c", tokens=40, blocks=[]))  # 40 ms alone, x3 fits; queued behind "a": refused
    assert not small.admitted
    clock.now = 0.5
    s.first_token("a")  # the queue is empty again
    assert s.admit(request("d", tokens=40, blocks=[])).admitted


def test_decode_workers_are_compared_as_they_run_not_as_they_calibrated():
    # d0 calibrated on a busy machine: its cost model says 21 ms a step alone, d1's 11 ms
    slow_calibration = beat("d0", "decode", cost=coefficients(decode_base=0.02))
    view, index, clock = cluster(beat("p0", "prefill"), slow_calibration, beat("d1", "decode"))
    s = Scheduler(build_policy("cache_aware"), view, index, config())
    assert s.admit(request("a")).decode_id == "d1"
    for _ in range(5):  # d0's requests decode twice as fast as its model says, d1's as fast
        s.margins.observe_tbt("d0", observed=0.0105, predicted=0.021)
        s.margins.observe_tbt("d1", observed=0.011, predicted=0.011)
    assert s.admit(request("b")).decode_id == "d0"  # 10.5 ms as it runs; d1 has "a": 12 ms
