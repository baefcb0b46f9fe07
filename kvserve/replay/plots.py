"""PNG plots of replay results: the TTFT CDF of each run, goodput and SLO
attainment against offered load when there are several, and the probes of
capacity searches. matplotlib (Agg) only."""

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from kvserve.replay.capacity import Capacity  # noqa: E402
from kvserve.replay.metrics import Summary  # noqa: E402
from kvserve.replay.records import Run  # noqa: E402


def ttft_cdf(runs: Sequence[Run], path: Path, slo_ttft_ms: float | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        ttfts = np.sort([r.ttft_s * 1000 for r in run.records if r.status == "ok" and r.ttft_s is not None])
        if ttfts.size:
            # the CDF over all requests sent: rejected and failed ones never reach 1
            ax.step(ttfts, np.arange(1, ttfts.size + 1) / len(run.records), where="post",
                    label=f"{run.label} ×{run.time_scale:g}")  # fmt: skip
    if slo_ttft_ms is not None:
        ax.axvline(slo_ttft_ms, color="grey", linestyle="--", linewidth=1, label="TTFT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests sent")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def goodput_vs_load(summaries: Sequence[Summary], path: Path, target: float = 0.9) -> Path:
    """Goodput (left) and SLO attainment (right) against offered load, one line per label."""
    by_label: dict[str, list[Summary]] = defaultdict(list)
    for s in summaries:
        if s.offered_rps is not None:
            by_label[s.label].append(s)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, points in by_label.items():
        points.sort(key=lambda s: s.offered_rps)
        load = [s.offered_rps for s in points]
        left.plot(load, [s.goodput_rps for s in points], marker="o", label=label)
        right.plot(load, [s.slo_attainment * 100 for s in points], marker="o", label=label)
    left.set_xlabel("offered load (req/s)")
    left.set_ylabel("goodput (req/s meeting both SLOs)")
    right.set_xlabel("offered load (req/s)")
    right.set_ylabel("SLO attainment (%)")
    right.axhline(target * 100, color="grey", linestyle="--", linewidth=1)
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def capacity_curves(capacities: Sequence[Capacity], path: Path) -> Path:
    """SLO attainment (left) and goodput (right) against offered load for each
    search's probes, one line per search; a star marks each capacity."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for capacity in capacities:
        points = sorted(capacity.probes, key=lambda p: p.offered_rps)
        load = [p.offered_rps for p in points]
        line = left.plot(load, [p.slo_attainment * 100 for p in points], marker="o", label=capacity.label)[0]
        right.plot(load, [p.goodput_rps for p in points], marker="o", color=line.get_color(), label=capacity.label)
        if capacity.best is not None:
            best = capacity.best
            left.plot([best.offered_rps], [best.slo_attainment * 100], marker="*", markersize=14,
                      color=line.get_color())  # fmt: skip
    if capacities:
        left.axhline(capacities[0].target * 100, color="grey", linestyle="--", linewidth=1, label="target")
    left.set_ylabel("SLO attainment (% of requests sent)")
    left.set_ylim(0, 102)
    right.set_ylabel("goodput (req/s meeting both SLOs)")
    right.set_ylim(bottom=0)
    for ax in (left, right):
        ax.set_xscale("log")
        for axis in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
            axis(FuncFormatter(lambda value, _: f"{value:g}"))  # 2, 3, 4 rather than 2×10⁰
        ax.set_xlabel("offered load (req/s, log scale)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
