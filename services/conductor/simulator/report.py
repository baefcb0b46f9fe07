"""What a simulation measured: one summary row per run, a text table, and a plot.

SLO attainment counts every request of the trace: a rejected or wasted one
missed its SLO. "admitted met SLO" is admission's promise: the share of the
admitted requests (wasted ones included) that met both SLOs, leaving out the
"best effort" ones, admitted with no promise (sent as best effort, or whose TBT
is predicted to miss its target even alone). Goodput is the requests that met both SLOs per second of the
trace. The cache hit rate is prompt tokens reused (own cache, store, a peer's
copy) over prompt tokens of the requests that were prefilled.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from libs.protocol.slo import SLO
from services.conductor.simulator.instances import SimRequest
from services.conductor.simulator.simulation import SimResult


@dataclass(frozen=True)
class Summary:
    policy: str
    requests: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tbt_p50: float
    tbt_p90: float
    tbt_p99: float
    slo_attainment: float  # fraction of all requests
    kept: float  # fraction of the admitted requests that met both SLOs (admission's promise), best effort aside
    best_effort: int  # admitted with no promise: sent as best effort, or over the TBT target even alone
    goodput: float  # requests meeting both SLOs per second
    rejected: int
    wasted: int  # prefilled, then refused by the decode instance
    wasted_prefill_s: float  # prefill seconds spent on them
    cache_hit_rate: float
    hit_by_tier: dict[str, float]
    prediction_error_s: float  # mean |actual - predicted| TTFT
    duration_s: float


def summarize(result: SimResult) -> Summary:
    slo = result.config.slo
    requests = result.requests
    done = [r for r in requests if r.outcome == "done"]
    ttft = np.array([r.ttft for r in done]) if done else np.zeros(1)
    tbts = [r.tbt for r in done if r.tbt is not None]
    tbt = np.array(tbts) if tbts else np.zeros(1)
    good = sum(1 for r in done if r.ttft <= slo.ttft_s and (r.tbt is None or r.tbt <= slo.tbt_s))
    wasted = [r for r in requests if r.outcome == "wasted"]
    prefilled = [r for r in requests if r.first_token is not None]
    prompt_tokens = sum(r.trace.input_length for r in prefilled) or 1
    by_tier: dict[str, float] = {}
    for r in prefilled:
        for tier, n in r.cached_tokens.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    span = max((r.trace.arrival_s for r in requests), default=0.0) or 1.0
    return Summary(
        policy=result.config.policy, requests=len(requests),
        ttft_p50=float(np.percentile(ttft, 50)), ttft_p90=float(np.percentile(ttft, 90)),
        ttft_p99=float(np.percentile(ttft, 99)),
        tbt_p50=float(np.percentile(tbt, 50)), tbt_p90=float(np.percentile(tbt, 90)),
        tbt_p99=float(np.percentile(tbt, 99)),
        slo_attainment=good / max(1, len(requests)), goodput=good / span,
        kept=kept(requests, slo), best_effort=sum(1 for r in requests if _best_effort(r)),
        rejected=sum(1 for r in requests if r.outcome == "rejected"), wasted=len(wasted),
        wasted_prefill_s=sum(r.prefill_seconds for r in wasted),
        cache_hit_rate=sum(by_tier.values()) / prompt_tokens,
        hit_by_tier={tier: n / prompt_tokens for tier, n in sorted(by_tier.items())},
        prediction_error_s=result.prediction_mean_abs_error_s, duration_s=result.duration_s,
    )  # fmt: skip


def _best_effort(r: SimRequest) -> bool:
    return r.outcome != "rejected" and r.decision is not None and r.decision.best_effort


def meets_slo(r: SimRequest, slo: SLO) -> bool:
    return r.outcome == "done" and r.ttft <= slo.ttft_s and (r.tbt is None or r.tbt <= slo.tbt_s)


def kept(requests: list[SimRequest], slo: SLO) -> float:
    """Of the admitted requests that were not best effort, the share that met both SLOs."""
    promised = [r for r in requests if r.outcome != "rejected" and not _best_effort(r)]
    return sum(1 for r in promised if meets_slo(r, slo)) / max(1, len(promised))


HEADER = ("policy", "TTFT p50/p90/p99 s", "TBT p50/p90/p99 ms", "SLO att.", "admitted met SLO", "best effort",
          "goodput r/s", "rejected", "wasted",
          "cache hit", "|pred err| s")  # fmt: skip


def rows(summaries: list[Summary]) -> list[tuple[str, ...]]:
    return [(
        s.policy, f"{s.ttft_p50:.2f} / {s.ttft_p90:.2f} / {s.ttft_p99:.2f}",
        f"{s.tbt_p50 * 1e3:.0f} / {s.tbt_p90 * 1e3:.0f} / {s.tbt_p99 * 1e3:.0f}",
        f"{s.slo_attainment:.1%}", f"{s.kept:.1%}", str(s.best_effort), f"{s.goodput:.2f}", str(s.rejected), f"{s.wasted} ({s.wasted_prefill_s:.0f} s)",
        f"{s.cache_hit_rate:.1%}", f"{s.prediction_error_s:.3f}",
    ) for s in summaries]  # fmt: skip


def table(summaries: list[Summary], markdown: bool = False) -> str:
    body = rows(summaries)
    if markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(HEADER)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(HEADER), fmt(["-" * w for w in widths]), *(fmt(r) for r in body)])


def plot(results: list[SimResult], path: Path) -> Path:
    """TTFT CDF per policy, and the decode load over time per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, load) = plt.subplots(1, 2, figsize=(13, 4.8))
    for result in results:
        ttft = np.sort([r.ttft for r in result.requests if r.outcome == "done"])
        if len(ttft):
            cdf.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=result.config.policy)
        times = [s.time for s in result.samples]
        load.plot(times, [s.decode_batch for s in result.samples], label=result.config.policy, linewidth=0.8)
    slo = results[0].config.slo if results else None
    if slo is not None:
        cdf.axvline(slo.ttft_s, color="grey", linestyle="--", linewidth=0.8, label=f"TTFT SLO {slo.ttft_s:g} s")
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (s)")
    cdf.set_ylabel("fraction of completed requests")
    cdf.set_title("TTFT")
    cdf.legend(fontsize=8)
    load.set_xlabel("simulated time (s)")
    load.set_ylabel("sequences on decode instances")
    load.set_title("decode load")
    load.legend(fontsize=8)
    c = results[0].config if results else None
    if c is not None:
        fig.suptitle(f"{len(results[0].requests)} requests, {c.num_prefill} prefill + {c.num_decode} decode, seed {c.seed}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
