"""The gateway's /metrics: several processes' expositions as one valid exposition."""

import logging

from prometheus_client.parser import text_string_to_metric_families

from libs.common.metrics import Metrics, merge_expositions


def process(instance: str, role: str, hits: int) -> str:
    m = Metrics(instance, role, "M")
    m.counter("kvserve_hits_total", "Hits", ["tier"]).labels("dram").inc(hits)
    m.histogram("kvserve_wait_seconds", "Waits", [1.0]).observe(0.5)
    if role == "gateway":
        m.gauge("kvserve_only_here", "Only in the gateway").set(1)
    return m.exposition()


def test_each_metric_once_with_every_instances_samples():
    merged = merge_expositions({"gateway-0": process("gateway-0", "gateway", 1), "store-0": process("store-0", "store", 2),
                                "store-1": process("store-1", "store", 3)})  # fmt: skip
    assert merged.count("# HELP kvserve_hits_total ") == 1 and merged.count("# TYPE kvserve_hits_total counter") == 1
    assert merged.count("# TYPE kvserve_wait_seconds histogram") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert set(families) == {"kvserve_hits", "kvserve_wait_seconds", "kvserve_only_here"}
    hits = {s.labels["instance"]: s.value for s in families["kvserve_hits"].samples}
    assert hits == {"gateway-0": 1, "store-0": 2, "store-1": 3}
    counts = [s for s in families["kvserve_wait_seconds"].samples if s.name == "kvserve_wait_seconds_count"]
    assert sorted(s.labels["instance"] for s in counts) == ["gateway-0", "store-0", "store-1"]


def test_a_text_that_does_not_parse_is_left_out_and_the_rest_served(caplog):
    with caplog.at_level(logging.WARNING):
        merged = merge_expositions({"store-0": process("store-0", "store", 2), "broken": "kvserve_x{ 1\n"})
    assert "broken" in caplog.text
    assert {s.labels["instance"] for f in text_string_to_metric_families(merged) for s in f.samples} == {"store-0"}


def test_a_family_of_another_type_and_repeated_samples_are_dropped(caplog):
    gauge = "# HELP kvserve_hits_total Hits\n# TYPE kvserve_hits_total gauge\nkvserve_hits_total{instance=\"odd\"} 5\n"
    same = process("store-0", "store", 2)
    with caplog.at_level(logging.WARNING):
        merged = merge_expositions({"store-0": same, "again": same, "odd": gauge})
    hits = [s for f in text_string_to_metric_families(merged) if f.name == "kvserve_hits" for s in f.samples]
    assert [(s.labels["instance"], s.value) for s in hits] == [("store-0", 2)]
    assert "odd" in caplog.text
