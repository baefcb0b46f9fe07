"""The gateway's per-request metrics: latencies from the times a run recorded, tokens,
finish reasons, and SLO verdicts (per target and both at once)."""

from types import SimpleNamespace

from libs.common.metrics import Metrics
from libs.protocol.slo import SLO, SLOOverride
from services.gateway.request_metrics import RequestMetrics

TARGETS = SLO(ttft_s=1.0, tbt_s=0.1)


def ended(finish_reason, deliveries=(), started=100.0, ended_at=None, taken=None, slo=None, tokens=None, migrations=0):
    """A request as the gateway's observer sees it once it is over (times in seconds)."""
    deliveries = [started + t for t in deliveries]
    text = SimpleNamespace(finish_reason=finish_reason, num_prompt_tokens=20, num_cached_tokens=16,
                           num_completion_tokens=len(deliveries) if tokens is None else tokens)
    return SimpleNamespace(
        run=SimpleNamespace(delivery_times=deliveries, taken_at=None if taken is None else started + taken,
                            migrations=migrations),
        text=text, usage=lambda: SimpleNamespace(completion_tokens=text.num_completion_tokens),
        slo=slo, started_at=started, ended_at=(deliveries[-1] if deliveries else started) if ended_at is None else ended_at,
    )  # fmt: skip


def test_latencies_and_tokens_of_a_finished_request():
    r = RequestMetrics(Metrics("gateway-0", "gateway", "M"), TARGETS)
    r.observe(ended("stop", deliveries=[0.5, 0.55, 0.65, 0.7], taken=0.2, migrations=1))
    assert r.ttft.value() == 1 and r.itl.value() == 3 and r.e2e.value() == 1 and r.queue.value() == 1
    registry = r.ttft._registry
    labels = {"instance": "gateway-0", "role": "gateway", "model_name": "M"}
    assert registry.get_sample_value("kvserve_time_to_first_token_seconds_sum", labels) == 0.5
    assert abs(registry.get_sample_value("kvserve_inter_token_latency_seconds_sum", labels) - 0.2) < 1e-9
    assert abs(registry.get_sample_value("kvserve_e2e_request_latency_seconds_sum", labels) - 0.7) < 1e-9
    assert abs(registry.get_sample_value("kvserve_request_queue_time_seconds_sum", labels) - 0.2) < 1e-9
    assert (r.prompt_tokens.value(), r.cached_tokens.value(), r.generation_tokens.value()) == (20, 16, 4)
    assert r.success.value("stop") == 1 and r.success.value("length") == 0 and r.migrations.value() == 1


def test_slo_verdicts_per_target_and_for_both():
    r = RequestMetrics(Metrics(), TARGETS)
    r.observe(ended("stop", deliveries=[0.5, 0.55, 0.6]))  # TTFT 0.5 s, TPOT 50 ms: both met
    r.observe(ended("length", deliveries=[1.5, 1.55, 1.6]))  # TTFT missed, TPOT met
    r.observe(ended("stop", deliveries=[0.2, 0.5, 0.8]))  # TTFT met, TPOT 300 ms missed
    r.observe(ended("stop", deliveries=[0.2]))  # one token: no TPOT verdict
    met = {slo: r.slo_met.value(slo) for slo in ("ttft", "tpot", "all")}
    missed = {slo: r.slo_missed.value(slo) for slo in ("ttft", "tpot", "all")}
    assert met == {"ttft": 3, "tpot": 2, "all": 2} and missed == {"ttft": 1, "tpot": 1, "all": 2}


def test_a_request_s_own_targets_are_the_ones_judged():
    r = RequestMetrics(Metrics(), TARGETS)
    r.observe(ended("stop", deliveries=[1.5, 1.55], slo=SLOOverride(ttft_s=2.0)))
    r.observe(ended("stop", deliveries=[0.5, 0.58], slo=SLOOverride(tbt_s=0.05)))
    assert (r.slo_met.value("ttft"), r.slo_missed.value("ttft")) == (2, 0)
    assert (r.slo_met.value("tpot"), r.slo_missed.value("tpot")) == (1, 1)


def test_an_error_misses_every_target_and_a_client_leaving_is_no_verdict():
    r = RequestMetrics(Metrics(), TARGETS)
    r.observe(ended("error", deliveries=[0.1]))
    r.observe(ended(None, deliveries=[0.1, 0.2]))  # the client left: no finish reason
    assert r.errors.value() == 1 and r.success.value("abort") == 1 and r.success.value("stop") == 0
    assert [r.slo_missed.value(s) for s in ("ttft", "tpot", "all")] == [1, 1, 1]
    assert [r.slo_met.value(s) for s in ("ttft", "tpot", "all")] == [0, 0, 0]
    assert r.e2e.value() == 2 and r.ttft.value() == 2
