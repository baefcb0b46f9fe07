"""Markdown for replay results: one table row per run, one block per run with
its latency percentiles. Formatting only; the numbers come from ``metrics``."""

from collections.abc import Sequence

from kvserve.replay.metrics import Distribution, Summary, goodput_at_attainment


def _num(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def runs_table(summaries: Sequence[Summary]) -> str:
    """One row per run: load, outcome counts, attainment, goodput and the headline latencies."""
    head = (
        "| run | time scale | offered req/s | sent | ok | 429 | errors | SLO attained | goodput req/s "
        "| throughput req/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | cached / cacheable tokens |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|\n"
    )
    rows = []
    for s in summaries:
        rows.append(
            f"| {s.label} | {s.time_scale:g} | {_num(s.offered_rps, 2)} | {s.requests} | {s.completed} "
            f"| {s.rejected} | {s.errors} | {s.slo_attainment:.1%} | {s.goodput_rps:.3f} | {s.throughput_rps:.3f} "
            f"| {_triple(s.ttft)} | {_triple(s.tpot)} | {s.cached_tokens:,} / {s.cacheable_tokens:,} |"
        )
    return head + "\n".join(rows) + "\n"


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
        f"SLOs: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms (vLLM's `--goodput` definitions).\n",
        runs_table(summaries),
    ]
    best = goodput_at_attainment(summaries, target)
    if len(summaries) > 1:
        parts.append(
            f"Goodput at {target:.0%} SLO attainment: "
            + (f"**{best.goodput_rps:.3f} req/s** (time scale {best.time_scale:g}).\n" if best else "no run reached it.\n")
        )
    for s in summaries:
        parts.append(f"## {s.label} at time scale {s.time_scale:g}\n\n{latency_table(s)}")
    return "\n".join(parts)
