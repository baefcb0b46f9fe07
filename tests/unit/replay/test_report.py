"""The band tables: one row per prompt-size band of a run, and a capacity search's
peak-goodput and capacity probes. Exact rows from hand-made records."""

from kvserve.replay.capacity import Capacity, Probe
from kvserve.replay.metrics import summarize
from kvserve.replay.records import RequestRecord, Run
from kvserve.replay.report import bands_table, capacity_bands, runs_table
from libs.protocol.slo import SLO

SLO_1S = SLO.from_ms(1000, 100)


def good(index: int, tokens: int, ttft: float) -> RequestRecord:
    return RequestRecord(index, float(index), tokens, 2, status="ok", start_s=float(index), ttft_s=ttft,
                         e2e_s=ttft + 0.05, output_tokens=2, ended_s=index + ttft + 0.05)  # fmt: skip


def refused(index: int, tokens: int) -> RequestRecord:
    return RequestRecord(index, float(index), tokens, 2, status="rejected", start_s=float(index), ended_s=index + 0.1)


def run(scale: float = 1.0) -> Run:
    records = [good(0, 100, 0.2), good(1, 300, 0.4), refused(2, 300), good(3, 1500, 1.2)]
    return Run("cfg", "http://x", scale, 10.0, records, {"block_tokens": 16})


def test_bands_table_has_a_row_per_band_with_counts_attainments_and_ttft():
    summary = summarize(run(), SLO_1S)
    assert bands_table([("cfg ×1", summary)]).splitlines()[2:] == [
        "| cfg ×1 | <128 | 1 | 1 | 0 | 0 | 0 | 1 | 100.0% | 100.0% | 200 / 200 |",
        "| cfg ×1 | 128-511 | 2 | 1 | 1 | 1 | 0 | 1 | 50.0% | 100.0% | 400 / 400 |",
        "| cfg ×1 | 512-1023 | 0 | 0 | 0 | 0 | 0 | 0 | – | – | – / – |",
        "| cfg ×1 | >=1024 | 1 | 1 | 0 | 0 | 0 | 0 | 0.0% | 0.0% | 1,200 / 1,200 |",
    ]


def test_runs_table_shows_idle_refusals_and_attainment_among_admitted():
    row = runs_table([summarize(run(), SLO_1S)]).splitlines()[2]
    assert row.startswith("| cfg | 1 | 1.00 | 4 | 3 | 1 | 1 (1) | 0 | 0 | 50.0% | 66.7% | 0.200 | 0.300 |")


def test_a_refusal_as_unattainable_is_counted_apart_not_as_refused_while_idle():
    records = [good(0, 100, 0.2), refused(2, 1500)]
    records[1].error_code = "slo_unattainable"
    summary = summarize(Run("cfg", "http://x", 1.0, 10.0, records, {"block_tokens": 16}), SLO_1S)
    assert (summary.rejected, summary.rejected_while_idle, summary.rejected_unattainable) == (1, 0, 1)


def test_capacity_bands_show_the_peak_goodput_probe_and_the_capacity_probe():
    light, heavy = summarize(run(2.0), SLO_1S), summarize(run(1.0), SLO_1S)
    probes = (Probe(2.0, 1.0, 0.95, 0.5, light), Probe(1.0, 2.0, 0.5, 0.6, heavy))
    rows = capacity_bands(Capacity("cfg", 0.9, probes)).splitlines()[2:]
    assert [r.split(" | ")[0:2] for r in rows[::4]] == [
        ["| peak goodput (×1, 2.000 req/s)", "<128"], ["| capacity (×2, 1.000 req/s)", "<128"],
    ]  # fmt: skip
    assert len(rows) == 8


def test_capacity_bands_name_one_probe_once_when_it_is_both():
    summary = summarize(run(), SLO_1S)
    rows = capacity_bands(Capacity("cfg", 0.9, (Probe(1.0, 2.0, 0.95, 0.6, summary),))).splitlines()[2:]
    assert len(rows) == 4
    assert rows[0].startswith("| peak goodput = capacity (×1, 2.000 req/s) | <128 |")
    assert capacity_bands(Capacity("cfg", 0.9, (Probe(1.0, 2.0, 0.95, 0.6),))) == ""  # no summaries
