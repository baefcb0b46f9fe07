"""bench/replay.py --find-capacity's comparison table: capacities, brackets, and
ratios to llama.cpp and to kvserve without prefix cache (peak goodput where a
side has no capacity)."""

from bench.capacity import comparison_table, document
from kvserve.replay.capacity import Capacity, Probe
from kvserve.replay.metrics import summarize
from kvserve.replay.records import RequestRecord, Run
from libs.protocol.slo import SLO


def searched(label: str, *points: tuple[float, float]) -> Capacity:
    """(offered req/s, attainment) per probe; goodput = attainment x load."""
    return Capacity(label, 0.9, tuple(Probe(1.0 / rps, rps, met, met * rps) for rps, met in points))


RESULTS = {
    "kvserve-default": searched("kvserve-default", (1.0, 1.0), (2.0, 0.95), (4.0, 0.5), (2.828, 0.92)),
    "kvserve-nocache": searched("kvserve-nocache", (1.0, 0.95), (2.0, 0.6), (1.414, 0.8)),
    "llama.cpp": searched("llama.cpp", (1.0, 0.3), (0.5, 0.8), (0.25, 0.85)),
}


def test_capacities_brackets_and_ratios_per_configuration():
    rows = comparison_table(RESULTS).splitlines()
    assert rows[0] == (
        "| configuration | capacity req/s | bracket width req/s | peak goodput req/s (at offered req/s) | probes "
        "| vs llama.cpp | vs kvserve-nocache |"
    )
    assert rows[2] == "| kvserve-default | 2.828 | 1.172 | 2.602 (2.828) | 4 | 6.50× peak goodput | 2.83× |"
    assert rows[3] == "| kvserve-nocache | 1.000 | 0.414 | 1.200 (2.000) | 3 | 3.00× peak goodput | 1.00× |"
    assert rows[4] == "| llama.cpp | no capacity | – | 0.400 (0.500) | 3 | 1.00× peak goodput | 0.33× peak goodput |"


def test_a_lower_bound_is_marked_and_a_missing_baseline_leaves_its_column_out():
    always = searched("kvserve-colocated", (1.0, 1.0), (2.0, 0.97))
    rows = comparison_table({"kvserve-colocated": always}).splitlines()
    assert rows[0].endswith("| probes |")
    assert rows[2] == "| kvserve-colocated | ≥ 2.000 | – | 1.940 (2.000) | 2 |"


def test_the_document_names_the_command_the_plot_and_each_configuration():
    text = document(RESULTS, SLO.from_ms(2000, 150), heading="H", command="python bench/replay.py --find-capacity",
                    window="W", plot_name="capacity.png")  # fmt: skip
    assert "Command: `python bench/replay.py --find-capacity`" in text and "`capacity.png`" in text
    assert "## llama.cpp\n\nno capacity: no load tried reached 90% SLO attainment" in text
    assert "TTFT <= 2000 ms and TPOT <= 150 ms" in text


def test_the_document_gives_each_configuration_the_bands_of_its_peak_and_capacity_probes():
    records = [RequestRecord(0, 0.0, 600, 2, status="ok", ttft_s=0.1, e2e_s=0.15, output_tokens=2, ended_s=0.15),
               RequestRecord(1, 1.0, 600, 2, status="rejected", start_s=1.0, ended_s=1.1)]  # fmt: skip
    summary = summarize(Run("kvserve-default", "http://x", 1.0, 2.0, records), SLO.from_ms(2000, 150))
    probe = Probe(1.0, 1.0, 0.5, 0.5, summary)
    text = document({"kvserve-default": Capacity("kvserve-default", 0.5, (probe,))}, SLO.from_ms(2000, 150), heading="H",
                    command="c", window="W", plot_name="capacity.png")  # fmt: skip
    assert "\"429 while idle\": refusals that arrived while no other request of the run awaited its first token" in text
    assert (
        "By prompt size, at peak goodput and at capacity:\n\n| run | prompt tokens |" in text
        and "| peak goodput = capacity (×1, 1.000 req/s) | 512-1023 | 2 | 1 | 1 | 1 | 0 | 1 | 50.0% | 100.0% "
        "| 100 / 100 |" in text
    )


def test_loads_beyond_the_capacity_get_their_runs_bands_and_the_peak_goodput_at_any_load():
    records = [RequestRecord(0, 0.0, 60, 2, status="ok", ttft_s=0.1, e2e_s=0.15, output_tokens=2, ended_s=0.15),
               RequestRecord(1, 1.0, 600, 2, status="rejected", start_s=1.0, ended_s=1.1)]  # fmt: skip
    over = summarize(Run("kvserve-default", "http://x", 0.25, 2.0, records), SLO.from_ms(2000, 150))
    default = RESULTS["kvserve-default"]
    results = {**RESULTS, "kvserve-default": Capacity("kvserve-default", 0.9, default.probes,
                                                      (Probe(0.25, 5.656, 0.5, 6.0, over),))}  # fmt: skip
    text = document(results, SLO.from_ms(2000, 150), heading="H", command="c", window="W", plot_name="p.png")
    assert "## Beyond capacity" in text
    assert "| kvserve-default ×2 capacity (5.656 req/s) | <128 | 1 | 1 | 0 |" in text
    assert "| kvserve-default ×2 capacity (5.656 req/s) | 512-1023 | 1 | 0 | 1 |" in text
    # 6.0 req/s beyond capacity against llama.cpp's 0.4 and kvserve-nocache's 1.2 (no probes beyond)
    assert "| kvserve-default | 6.000 (5.656) | 15.00× | 5.00× |" in text
    assert "| llama.cpp | 0.400 (0.500) | 1.00× | 0.33× |" in text
    assert "Beyond capacity" not in document(RESULTS, SLO.from_ms(2000, 150), heading="H", command="c", window="W",
                                             plot_name="p.png")  # fmt: skip
