"""What `bench/replay.py --find-capacity` writes: each configuration's effective
request capacity (the highest offered load at which the target share of requests
meets both SLOs) and peak goodput, their ratios to llama.cpp, to kvserve
without prefix cache and to the earlier checkout (kvserve-baseline), every probe, and the prompt-size bands of each
configuration's peak-goodput and capacity probes; with probes beyond the
capacity (``--beyond``), what each configuration kept there and its peak
goodput at any load tried. Formatting only; the searches are
``kvserve.replay.capacity``'s and the plot ``kvserve.replay.plots``'."""

from collections.abc import Mapping, Sequence

from kvserve.replay.capacity import Capacity
from kvserve.replay.report import BANDS_LEGEND, bands_table, capacity_bands, capacity_verdict, probes_table, runs_table
from libs.protocol.slo import SLO

BASELINES = ("llama.cpp", "kvserve-nocache", "kvserve-baseline")


def capacity_cell(capacity: Capacity) -> str:
    if capacity.best is None:
        return "no capacity"
    bound = "≥ " if capacity.first_failure_above is None else ""  # every load tried passed
    return f"{bound}{capacity.capacity_rps:.3f}"


def ratio(capacity: Capacity, baseline: Capacity | None) -> str:
    """Capacity over the baseline's; peak goodput over its peak goodput when either has no capacity."""
    if baseline is None:
        return "–"
    if capacity.capacity_rps is not None and baseline.capacity_rps is not None:
        return f"{capacity.capacity_rps / baseline.capacity_rps:.2f}×"
    base_peak = baseline.peak_goodput.goodput_rps
    if base_peak <= 0:
        return "– (baseline: no goodput)"
    return f"{capacity.peak_goodput.goodput_rps / base_peak:.2f}× peak goodput"


def _head(columns: str, align: str, baselines: Sequence[str]) -> list[str]:
    """A table's header rows: ``columns``, then a "vs" column per baseline."""
    return [f"| {columns} " + "".join(f"| vs {name} " for name in baselines) + "|",
            f"|{align}" + "|---:" * len(baselines) + "|"]  # fmt: skip


def comparison_table(results: Mapping[str, Capacity]) -> str:
    baselines = [name for name in BASELINES if name in results]
    lines = _head("configuration | capacity req/s | bracket width req/s | peak goodput req/s (at offered req/s) | probes",
                  "---|---:|---:|---:|---:", baselines)  # fmt: skip
    for name, capacity in results.items():
        width = capacity.precision_rps
        peak = capacity.peak_goodput
        lines.append(
            f"| {name} | {capacity_cell(capacity)} | {'–' if width is None else f'{width:.3f}'} "
            f"| {peak.goodput_rps:.3f} ({peak.offered_rps:.3f}) | {len(capacity.probes)} "
            + "".join(f"| {ratio(capacity, results[b])} " for b in baselines) + "|"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def document(
    results: Mapping[str, Capacity],
    slo: SLO,
    *,
    heading: str,
    command: str,
    window: str,
    plot_name: str,
    notes: Sequence[str] = (),
) -> str:
    target = next(iter(results.values())).target if results else 0.9
    parts = [
        f"# {heading}\n",
        f"{window}\n",
        f"Command: `{command}`\n",
        f"Effective request capacity: the highest offered load (req/s) at which at least {target:.0%} of the "
        f"requests sent meet TTFT <= {slo.ttft_s * 1e3:g} ms and TPOT <= {slo.tbt_s * 1e3:g} ms (rejected ones do not), "
        "found by halving or doubling the trace's time scale until a probe passes and one fails, then "
        "bisecting between them in log space; probe i of every configuration uses prompt seed seed+i. "
        "The bracket width is how far above the capacity the next load tried failed. Where a configuration "
        "has no capacity the ratios compare peak goodput.\n",
        comparison_table(results),
        BANDS_LEGEND,
        f"Attainment and goodput against offered load, a line per configuration: `{plot_name}`.\n",
        *(f"- {note}" for note in notes),
    ]
    if beyond := beyond_section(results):
        parts.append(beyond)
    for name, capacity in results.items():
        parts.append(f"\n## {name}\n\n{capacity_verdict(capacity)}.\n\n{probes_table(capacity)}")
        if bands := capacity_bands(capacity):
            parts.append(f"By prompt size, at peak goodput and at capacity:\n\n{bands}")
    return "\n".join(parts)


def beyond_section(results: Mapping[str, Capacity]) -> str:
    """The probes past each capacity (runs and prompt-size bands, named by their multiple of
    the capacity) and every configuration's peak goodput at any load tried, with its ratios;
    "" when there are none."""
    probed = {name: c for name, c in results.items() if c.beyond}
    if not probed:
        return ""
    summaries, bands = [], []
    for name, c in probed.items():
        for p in c.beyond:
            if p.summary is not None:
                summaries.append(p.summary)
                bands.append((f"{name} ×{p.offered_rps / c.capacity_rps:.2g} capacity ({p.offered_rps:.3f} req/s)",
                              p.summary))  # fmt: skip
    baselines = [name for name in BASELINES if name in results]
    lines = _head("configuration | peak goodput req/s at any load tried (at offered req/s)", "---|---:", baselines)
    for name, c in results.items():
        peak = c.peak_goodput_any
        cells = "".join(f"| {_over(peak.goodput_rps, results[b].peak_goodput_any.goodput_rps)} " for b in baselines)
        lines.append(f"| {name} | {peak.goodput_rps:.3f} ({peak.offered_rps:.3f}) {cells}|")
    return "\n".join([
        "\n## Beyond capacity\n",
        "After its search each configuration with a capacity was probed again at multiples of it (the same prompt "
        "seed for every configuration at a multiple). \"admitted in SLO\" is what admission promises: of the requests "
        "it did not refuse, the share that met both SLOs.\n",
        runs_table(summaries), bands_table(bands),
        "Peak goodput over every load tried, the search's and these:\n", "\n".join(lines) + "\n",
    ])  # fmt: skip


def _over(value: float, base: float) -> str:
    return f"{value / base:.2f}×" if base > 0 else "–"
