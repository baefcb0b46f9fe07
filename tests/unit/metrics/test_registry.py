"""One process's metrics: its own registry, the identity labels on every sample,
declarations, read-on-scrape metrics, and an exposition Prometheus parses."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.common.metrics import Metrics
from libs.protocol.models import model_name


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """Every sample of the exposition, parsed: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.exposition()) for s in family.samples}  # fmt: skip


IDENTITY = (("instance", "store-0"), ("model_name", "M"), ("role", "store"))


def test_every_sample_carries_the_instance_role_and_model_name():
    m = Metrics("store-0", "store", "M")
    m.counter("kvserve_things_total", "Things", ["tier"]).labels("dram").inc(3)
    m.histogram("kvserve_wait_seconds", "Waits", [0.1, 1.0]).observe(0.5)
    m.gauge("kvserve_level", "Level").set(7)
    found = samples(m)
    assert found[("kvserve_things_total", (*IDENTITY[:2], ("role", "store"), ("tier", "dram")))] == 3
    assert found[("kvserve_wait_seconds_bucket", (*IDENTITY[:1], ("le", "1.0"), *IDENTITY[1:]))] == 1
    assert found[("kvserve_wait_seconds_bucket", (*IDENTITY[:1], ("le", "0.1"), *IDENTITY[1:]))] == 0
    assert found[("kvserve_wait_seconds_sum", IDENTITY)] == 0.5
    assert found[("kvserve_level", IDENTITY)] == 7
    assert all(dict(labels).keys() >= {"instance", "role", "model_name"} for _, labels in found)


def test_two_processes_metrics_in_one_process_stay_apart():
    a, b = Metrics("a", "prefill", "M"), Metrics("b", "prefill", "M")
    a.counter("kvserve_x_total", "X").inc(2)
    b.counter("kvserve_x_total", "X").inc(5)
    assert a.counter("kvserve_x_total", "X").value() == 2  # declaring again returns the first declaration
    assert b.counter("kvserve_x_total", "X").value() == 5
    assert "instance=\"b\"" not in a.exposition()


def test_metrics_appear_at_zero_before_anything_happens():
    m = Metrics("d", "decode", "M")
    m.counter("kvserve_plain_total", "Plain")
    m.counter("kvserve_by_tier_total", "By tier", ["tier"], ["dram", "disk"])
    m.counter("kvserve_by_pair_total", "By pair", ["transport", "cause"], [("tcp", "timeout")])
    found = {(name, dict(labels).get("tier") or dict(labels).get("cause")): v for (name, labels), v in samples(m).items()}
    assert found == {("kvserve_plain_total", None): 0, ("kvserve_by_tier_total", "dram"): 0,
                     ("kvserve_by_tier_total", "disk"): 0, ("kvserve_by_pair_total", "timeout"): 0}  # fmt: skip


def test_declarations_are_checked():
    m = Metrics()
    with pytest.raises(ValueError, match="_total"):
        m.counter("kvserve_things", "Things")
    m.counter("kvserve_things_total", "Things", ["tier"])
    with pytest.raises(ValueError, match="twice"):
        m.counter("kvserve_things_total", "Things", ["cause"])
    with pytest.raises(ValueError, match="twice"):
        m.gauge("kvserve_things_total", "Things", ["tier"])
    with pytest.raises(ValueError, match="takes labels"):
        m.counter("kvserve_things_total", "Things", ["tier"]).labels()


def test_values_kept_elsewhere_are_read_when_scraped():
    tally = {"hits": 1}
    m = Metrics("s", "store", "M")
    m.counter_function("kvserve_hits_total", "Hits", lambda: {("dram",): tally["hits"]}, ["tier"])
    m.gauge_function("kvserve_blocks", "Blocks", lambda: {(): 4})
    m.histogram_function("kvserve_error_seconds", "Signed errors",
                         lambda: {(): ([(-1.0, 1), (0.0, 1), (1.0, 3), (float("inf"), 4)], 2.5)})  # fmt: skip
    tally["hits"] = 9
    found = samples(m)
    assert found[("kvserve_hits_total", (*IDENTITY[:0], ("instance", "s"), ("model_name", "M"), ("role", "store"),
                                         ("tier", "dram")))] == 9  # fmt: skip
    plain = (("instance", "s"), ("model_name", "M"), ("role", "store"))
    assert found[("kvserve_blocks", plain)] == 4
    assert found[("kvserve_error_seconds_count", plain)] == 4  # kept although a bound is negative
    assert found[("kvserve_error_seconds_sum", plain)] == 2.5
    assert found[("kvserve_error_seconds_bucket", (plain[0], ("le", "-1.0"), *plain[1:]))] == 1
    with pytest.raises(ValueError, match="twice"):
        m.gauge_function("kvserve_blocks", "Blocks", lambda: {})


def test_the_model_name_is_the_gateways_model_id():
    assert model_name(None) == model_name("SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert model_name("/models/Llama-3.2-1B") == "Llama-3.2-1B"
    assert model_name("/models/tiny.Q8_0.gguf") == "tiny.Q8_0"
