"""What `bench/replay.py --find-capacity` writes: each configuration's effective
request capacity (the highest offered load at which the target share of requests
meets both SLOs) and peak goodput, their ratios to llama.cpp, to kvserve
without prefix cache and to the earlier checkout (kvserve-baseline), every probe, and the prompt-size bands of each
configuration's peak-goodput and capacity probes. Formatting only; the searches are
``kvserve.replay.capacity``'s and the plot ``kvserve.replay.plots``'."""

from collections.abc import Mapping, Sequence

from kvserve.replay.capacity import Capacity
from kvserve.replay.report import BANDS_LEGEND, capacity_bands, capacity_verdict, probes_table
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


def comparison_table(results: Mapping[str, Capacity]) -> str:
    baselines = [name for name in BASELINES if name in results]
    lines = [
        "| configuration | capacity req/s | bracket width req/s | peak goodput req/s (at offered req/s) | probes "
        + "".join(f"| vs {name} " for name in baselines) + "|",
        "|---|---:|---:|---:|---:" + "|---:" * len(baselines) + "|",
    ]  # fmt: skip
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
    for name, capacity in results.items():
        parts.append(f"\n## {name}\n\n{capacity_verdict(capacity)}.\n\n{probes_table(capacity)}")
        if bands := capacity_bands(capacity):
            parts.append(f"By prompt size, at peak goodput and at capacity:\n\n{bands}")
    return "\n".join(parts)
