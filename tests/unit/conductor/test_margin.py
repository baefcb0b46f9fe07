"""Admission that keeps its promise: instance speeds and safety margins learned from
observed prediction errors, and never a refusal on an idle cluster."""

import random

import pytest

from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from services.conductor.margin import MIN_SAMPLES, TTFT_SLACK_S, Margins, RatioWindow
from services.conductor.simulator.report import kept
from services.conductor.simulator.simulation import SimConfig, Simulation
from services.conductor.simulator.trace import TraceRequest
from tests.unit.conductor.helpers import Clock, beat, cluster, coefficients, config, request


def test_a_window_gives_its_quantile_within_bounds_and_one_while_empty():
    w = RatioWindow(size=100, quantile=0.95, low=0.5, high=20.0)
    assert w.value() == 1.0
    for i in range(100):
        w.observe(observed=1.0 + i / 100, predicted=1.0)
    assert w.value() == pytest.approx(1.95)
    w.observe(observed=1000.0, predicted=1.0)  # the oldest ratio leaves the window
    assert w.value() == pytest.approx(1.96)
    w.observe(observed=5.0, predicted=0.0)  # says nothing: ignored
    assert len(w) == 100
    assert RatioWindow(size=10, quantile=0.5, low=1.0, high=1.5).value() == 1.0
    capped = RatioWindow(size=10, quantile=0.5, low=1.0, high=1.5)
    capped.observe(observed=30.0, predicted=1.0)
    assert capped.value() == 1.5  # an outlier cannot push a margin past its bound


def test_a_window_forgets_ratios_older_than_its_age():
    clock = Clock()
    w = RatioWindow(size=100, quantile=0.5, low=0.5, high=20.0, max_age_s=60.0, clock=clock)
    w.observe(observed=10.0, predicted=1.0)
    clock.now = 30.0
    w.observe(observed=2.0, predicted=1.0)
    assert (len(w), w.value()) == (2, 10.0)
    clock.now = 61.0  # the first ratio is too old
    assert (len(w), w.value()) == (1, 2.0)
    assert w.value() == 2.0  # read again, unchanged
    clock.now = 91.0  # and then the second
    assert (w.value(), len(w)) == (1.0, 0)
    w.observe(observed=3.0, predicted=1.0)
    assert (len(w), w.value()) == (1, 3.0)


def test_the_speeds_read_at_once_are_each_instances_own_or_the_clusters():
    clock = Clock()
    margins = Margins(clock=clock)
    for i in range(30):  # 'fast' has speeds of its own; 'new' two samples only; 'never' none
        margins.observe_tbt("fast" if i % 3 else "new" if i < 6 else "other", observed=0.5 if i % 3 else 2.0,
                            predicted=1.0)  # fmt: skip
    speeds = margins.decode_speeds()
    for instance_id in ("fast", "new", "other", "never"):
        assert speeds(instance_id) == margins.decode_speed(instance_id)
    assert speeds("fast") == 0.5 and speeds("never") == margins.decode_speed_all.value()
    clock.now = 10_000.0  # every sample forgotten: the default for all
    assert margins.decode_speeds()("fast") == 1.0 == margins.decode_speed("fast")


def test_ttft_slack_is_per_prompt_size_band_with_every_bands_as_the_fallback():
    m = Margins()
    for _ in range(MIN_SAMPLES - 1):
        m.observe_ttft(1500, observed=1.4, predicted=1.0)
    assert m.ttft(1500) == 0.0  # too few anywhere
    m.observe_ttft(1500, observed=1.4, predicted=1.0)
    for _ in range(MIN_SAMPLES):
        m.observe_ttft(40, observed=0.15, predicted=0.05)
    # a long prompt's errors do not widen a short one's slack, nor the other way round
    assert (m.ttft(1500), m.ttft(40), m.ttft(300)) == pytest.approx((0.4, 0.1, 0.4))
    for _ in range(MIN_SAMPLES):
        m.observe_ttft(40, observed=50.0, predicted=1.0)  # a burst of wild errors
    assert m.ttft(40) == TTFT_SLACK_S[1]  # bounded


def test_samples_taken_across_a_fault_or_a_migration_teach_the_margins_nothing():
    view, index, clock = cluster(beat("p0", "prefill"), beat("d0", "decode"))
    s = Admitter(build_policy("cache_aware+predictive_rejection"), view, index, config())
    clock.now = 100.0
    view.observe(beat("p0", "prefill"))
    view.observe(beat("d0", "decode", started_at=50.0))  # d0 restarted
    for i in range(MIN_SAMPLES):
        s.admit(request(f"a{i}", tokens=40, blocks=[]))
        s.first_token(f"a{i}", ttft_s=5.0)  # slow: the restart's doing
    assert len(s.margins.ttft_all) == 0
    clock.now = 200.0  # long after the fault
    view.observe(beat("p0", "prefill"))
    view.observe(beat("d0", "decode", started_at=50.0))
    for i in range(MIN_SAMPLES):
        s.admit(request(f"m{i}", tokens=40, blocks=[], moved=True))
        s.first_token(f"m{i}", ttft_s=5.0)  # a moved request re-prefills what it streamed: not a sample
    assert len(s.margins.ttft_all) == 0
    s.admit(request("b", tokens=40, blocks=[]))
    s.first_token("b", ttft_s=0.05)
    assert len(s.margins.ttft_all) == 1


def test_what_runs_while_an_instance_warms_up_teaches_nothing():
    view, index, clock = cluster(beat("p0", "prefill"), beat("d0", "decode"))
    s = Admitter(build_policy("cache_aware+predictive_rejection"), view, index, config())
    clock.now = 1.0
    view.observe(beat("p0", "prefill", warming=True))  # its start-up work shares its cores
    view.observe(beat("d0", "decode"))
    for i in range(MIN_SAMPLES):
        assert s.admit(request(f"a{i}", tokens=40, blocks=[])).admitted
        clock.now += 0.05
        s.first_token(f"a{i}", ttft_s=5.0)  # slow: the start-up work's doing
        s.finished(f"a{i}", num_output_tokens=10)
    assert (len(s.margins.ttft_all), len(s.margins.speed_all), len(s.margins.tbt_all)) == (0, 0, 0)
    clock.now = 30.0  # warm: its requests teach again, a grace period on
    view.observe(beat("p0", "prefill"))
    view.observe(beat("d0", "decode"))
    assert s.admit(request("b", tokens=40, blocks=[])).admitted
    clock.now = 30.05
    s.first_token("b", ttft_s=0.05)
    assert (len(s.margins.ttft_all), len(s.margins.speed_all)) == (1, 1)


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
    assert 1.35 < sim.view.get("prefill-0").heartbeat.prefill_speed < 1.65  # the workers measure how slow they are
    assert margins.tbt("decode-0") > 1.3


def test_an_idle_cluster_admits_what_fits_and_the_margin_stays_bounded():
    view, index, clock = cluster(beat("p0", "prefill"), beat("d0", "decode"))
    s = Admitter(build_policy("cache_aware+predictive_rejection"), view, index, config(ttft_s=0.8))
    for _ in range(MIN_SAMPLES):  # predictions have been 2 s too optimistic
        s.margins.observe_ttft(170, observed=3.0, predicted=1.0)
        s.margins.observe_ttft(40, observed=3.0, predicted=1.0)
        s.margins.observe_tbt("d0", observed=3.0, predicted=1.0)
    # 170 tokens at 1 ms: 0.170 s alone + 0.5 s (the bound, not 2 s) = 0.67 s: fits the 0.8 s target
    first = s.admit(request("a"))
    assert first.admitted and not first.best_effort
    assert first.predicted_ttft_s == pytest.approx(0.170)
    second = s.admit(request("b"))  # behind it: refused, the slack added to the queue's prediction
    assert (second.admitted, second.reason) == (False, "ttft_slo")
    assert "+ 0.500 s slack" in second.error_message
    small = s.admit(request("c", tokens=40, blocks=[]))  # 40 ms alone; after "a" (not cut): 0.21 + 0.5 fits
    assert small.admitted
    clock.now = 0.5
    s.first_token("a")
    hopeless = s.admit(request("e", tokens=350, blocks=[]))  # 0.35 s alone + 0.5 misses even on an idle worker
    assert (hopeless.reason, hopeless.retry_after_s) == ("slo_unattainable", None)


def test_decode_workers_are_compared_as_they_run_not_as_they_calibrated():
    # d0 calibrated on a busy machine: its cost model says 21 ms a step alone, d1's 11 ms
    slow_calibration = beat("d0", "decode", cost=coefficients(decode_base=0.02))
    view, index, clock = cluster(beat("p0", "prefill"), slow_calibration, beat("d1", "decode"))
    s = Admitter(build_policy("cache_aware"), view, index, config())
    assert s.admit(request("a")).decode_id == "d1"
    for _ in range(5):  # d0's requests decode twice as fast as its model says, d1's as fast
        s.margins.observe_tbt("d0", observed=0.0105, predicted=0.021)
        s.margins.observe_tbt("d1", observed=0.011, predicted=0.011)
    assert s.admit(request("b")).decode_id == "d0"  # 10.5 ms as it runs; d1 has "a": 12 ms
