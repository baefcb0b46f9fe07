"""Markdown for replay results: one table row per run, its prompt-size bands, one
block per run with its latency percentiles. Formatting only; the numbers come
from ``metrics``."""

from collections.abc import Sequence

from kvserve.replay.capacity import Capacity
from kvserve.replay.metrics import NEAR_IDLE_S, Distribution, Summary, goodput_at_attainment
from libs.protocol.slo import SLO


def _num(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _count(value: int | None) -> str:
    return "–" if value is None else str(value)


def runs_table(summaries: Sequence[Summary]) -> str:
    """One row per run: load, outcome counts, attainment, goodput and the headline latencies.
    "429 while idle": refusals made while no other request awaited its first token (not
    counting "unattainable" ones: refused as unable to meet the SLO even alone), and in
    brackets those made at most ``NEAR_IDLE_S`` before the server went idle (the idle
    ones included);
    "admitted in SLO": good requests over those not refused."""
    head = (
        "| run | time scale | offered req/s | sent | ok | 429 | 429 while idle (near) | 429 unattainable | errors "
        "| SLO attained | admitted in SLO | goodput req/s | throughput req/s | TTFT p50 / p90 / p99 ms "
        "| TPOT p50 / p90 / p99 ms | cached / cacheable tokens |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|\n"
    )
    rows = []
    for s in summaries:
        rows.append(
            f"| {s.label} | {s.time_scale:g} | {_num(s.offered_rps, 2)} | {s.requests} | {s.completed} "
            f"| {s.rejected} | {_idle(s)} | {s.rejected_unattainable} | {s.errors} "
            f"| {s.slo_attainment:.1%} "
            f"| {_share(s.admitted_attainment)} | {s.goodput_rps:.3f} | {s.throughput_rps:.3f} "
            f"| {_triple(s.ttft)} | {_triple(s.tpot)} | {s.cached_tokens:,} / {s.cacheable_tokens:,} |"
        )
    return head + "\n".join(rows) + "\n"


def _idle(s: Summary) -> str:
    near = "" if s.rejected_near_idle is None else f" ({s.rejected_near_idle})"
    return _count(s.rejected_while_idle) + near


BANDS_LEGEND = (
    "\"admitted in SLO\": good requests over those not refused (HTTP 429); \"429 while idle\": refusals that "
    "arrived while no other request of the run awaited its first token; \"(near)\", in brackets: those and the "
    f"ones that arrived at most {NEAR_IDLE_S:g} s before the server went idle (about one 256-token prefill "
    "chunk here).\n"
)


def bands_table(runs: Sequence[tuple[str, Summary]]) -> str:
    """One row per prompt-size band of each (name, run): outcomes, attainment of all
    and of admitted requests, TTFT of completed ones. A run summarized before bands
    existed has none."""
    lines = [
        "| run | prompt tokens | sent | ok | 429 | 429 while idle | errors | good | SLO attained "
        "| admitted in SLO | TTFT p50 / p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, s in runs:
        for b in s.bands:
            lines.append(
                f"| {name} | {b.band} | {b.requests} | {b.completed} | {b.rejected} | {_count(b.rejected_while_idle)} "
                f"| {b.errors} | {b.good} | {_share(b.slo_attainment)} | {_share(b.admitted_attainment)} "
                f"| {_num(b.ttft.p50)} / {_num(b.ttft.p99)} |"
            )
    return "\n".join(lines) + "\n"


def run_name(summary: Summary) -> str:
    return f"{summary.label} ×{summary.time_scale:g}"


def _triple(d: Distribution) -> str:
    return f"{_num(d.p50)} / {_num(d.p90)} / {_num(d.p99)}"


def latency_table(summary: Summary) -> str:
    lines = ["| metric (ms) | n | mean | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|---:|"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        d: Distribution = getattr(summary, name)
        lines.append(
            f"| {name.upper()} | {d.count} | {_num(d.mean, 1)} | {_num(d.p50, 1)} | {_num(d.p90, 1)} | {_num(d.p99, 1)} |"
        )
    return "\n".join(lines) + "\n"


def markdown(summaries: Sequence[Summary], title: str = "Trace replay", target: float = 0.9) -> str:
    """A whole summary document for the runs of one `kvserve bench` invocation."""
    slo = summaries[0].slo
    parts = [
        f"# {title}\n",
        f"SLOs: TTFT <= {slo.ttft_s * 1e3:g} ms and TPOT <= {slo.tbt_s * 1e3:g} ms (vLLM's `--goodput` definitions).\n",
        BANDS_LEGEND,
        runs_table(summaries),
    ]
    best = goodput_at_attainment(summaries, target)
    if len(summaries) > 1:
        parts.append(
            f"Goodput at {target:.0%} SLO attainment: "
            + (f"**{best.goodput_rps:.3f} req/s** (time scale {best.time_scale:g}).\n" if best else "no run reached it.\n")
        )
    parts.append("## By prompt size\n\n" + bands_table([(run_name(s), s) for s in summaries]))
    for s in summaries:
        parts.append(f"## {s.label} at time scale {s.time_scale:g}\n\n{latency_table(s)}")
    return "\n".join(parts)


def capacity_verdict(capacity: Capacity) -> str:
    """One sentence: the capacity and how closely it is bracketed, or that there is none."""
    target, best, above = capacity.target, capacity.best, capacity.first_failure_above
    peak = capacity.peak_goodput
    if best is None:
        lightest = min(capacity.probes, key=lambda p: p.offered_rps)
        return (
            f"no capacity: no load tried reached {target:.0%} SLO attainment (the lightest, "
            f"{lightest.offered_rps:.3f} req/s, attained {lightest.slo_attainment:.1%}); "
            f"peak goodput {peak.goodput_rps:.3f} req/s at {peak.offered_rps:.3f} req/s offered"
        )
    if above is None:
        return (
            f"capacity at least {best.offered_rps:.3f} req/s: every load tried reached {target:.0%} "
            f"SLO attainment, so the heaviest (time scale {best.time_scale:g}) is only a lower bound; "
            f"peak goodput {peak.goodput_rps:.3f} req/s"
        )
    return (
        f"capacity {best.offered_rps:.3f} req/s at {target:.0%} SLO attainment (time scale "
        f"{best.time_scale:g}, {best.slo_attainment:.1%} attained); {above.offered_rps:.3f} req/s "
        f"attained {above.slo_attainment:.1%}, so the capacity is known to within "
        f"{capacity.precision_rps:.3f} req/s; peak goodput {peak.goodput_rps:.3f} req/s"
    )


def probes_table(capacity: Capacity) -> str:
    """One row per probe, in the order the search ran them."""
    lines = [
        "| probe | time scale | offered req/s | SLO attained | goodput req/s | meets target |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for i, p in enumerate(capacity.probes):
        lines.append(
            f"| {i} | {p.time_scale:.4g} | {p.offered_rps:.3f} | {p.slo_attainment:.1%} | {p.goodput_rps:.3f} "
            f"| {'yes' if capacity.passes(p) else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def capacity_markdown(capacity: Capacity, slo: SLO, title: str = "Capacity search") -> str:
    """The document ``kvserve bench --find-capacity`` writes: verdict, probes, then each run's latencies."""
    parts = [
        f"# {title}\n",
        f"Effective request capacity: the highest offered load at which at least {capacity.target:.0%} of "
        f"the requests sent meet TTFT <= {slo.ttft_s * 1e3:g} ms and TPOT <= {slo.tbt_s * 1e3:g} ms "
        "(rejected and failed requests do not).\n",
        f"**{capacity_verdict(capacity)}.**\n",
        probes_table(capacity),
    ]
    summaries = [p.summary for p in capacity.probes if p.summary is not None]
    if summaries:
        parts.append(runs_table(summaries))
    if bands := capacity_bands(capacity):
        parts.append("## By prompt size\n\n" + bands)
    return "\n".join(parts)


def capacity_bands(capacity: Capacity) -> str:
    """The prompt-size bands of the peak-goodput probe and of the capacity probe (one
    set of rows when they are the same probe); "" when neither has a summary."""
    picked = {"peak goodput": capacity.peak_goodput, "capacity": capacity.best}
    rows: list[tuple[str, Summary]] = []
    for role, probe in picked.items():
        if probe is None or probe.summary is None:
            continue
        name = f"{role} (×{probe.time_scale:.4g}, {probe.offered_rps:.3f} req/s)"
        if rows and rows[-1][1] is probe.summary:
            rows[-1] = (f"peak goodput = {name}", probe.summary)
        else:
            rows.append((name, probe.summary))
    return bands_table(rows) if rows else ""
