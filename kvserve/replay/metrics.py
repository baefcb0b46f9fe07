"""From request records to the figures a serving benchmark reports: latency
percentiles, SLO attainment and goodput, with ``vllm bench serve --goodput``'s
definitions.

- TTFT: send to first text chunk. ITL: every gap between two text chunks, all
  requests pooled. TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request
  (0 for one-token answers, which vLLM leaves out of the TPOT percentiles but
  feeds to goodput as 0). E2E: send to end of stream.
- A request is *good* when it completed and meets every SLO, inclusively
  (``ttft <= slo_ttft`` and ``tpot <= slo_tpot``); the TBT objective is checked
  on TPOT, as vLLM's goodput does.
- Goodput: good requests per second of the run's duration (vLLM's
  ``request_goodput``). SLO attainment: good requests over all requests sent;
  rejected and failed ones count against it.
- Goodput at a target attainment, over a load sweep: the highest goodput among
  the runs whose attainment reaches the target (DistServe's definition, on the
  loads swept).
"""

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvserve.replay.records import RequestRecord, Run

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = 2000.0
    tpot_ms: float = 150.0

    def is_good(self, record: RequestRecord) -> bool:
        tpot = record.tpot_s
        return (
            record.status == "ok"
            and record.ttft_s is not None
            and tpot is not None
            and record.ttft_s * 1000 <= self.ttft_ms
            and tpot * 1000 <= self.tpot_ms
        )


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in ms; all None when nothing was measured."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, seconds: Iterable[float]) -> "Distribution":
        values = np.asarray(list(seconds), dtype=np.float64) * 1000.0
        if values.size == 0:
            return cls(0, None, None, None, None)
        p50, p90, p99 = (float(v) for v in np.percentile(values, PERCENTILES))
        return cls(int(values.size), float(values.mean()), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    label: str
    time_scale: float
    offered_rps: float | None
    duration_s: float
    requests: int
    completed: int
    rejected: int
    errors: int
    good: int
    slo_attainment: float  # good / requests
    goodput_rps: float  # good / duration
    throughput_rps: float  # completed / duration
    output_tokens_per_s: float
    prompt_tokens: int  # over completed requests, as sent
    cached_tokens: int  # over completed requests, as the server reported
    cacheable_tokens: int  # over completed requests: the prefix blocks an earlier request had sent
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    slo: SLO

    def to_json(self) -> dict:
        return asdict(self)


def summarize(run: Run, slo: SLO, block_tokens: int | None = None) -> Summary:
    """Reduce one run. ``block_tokens`` turns expected cached blocks into tokens."""
    records = run.records
    done = [r for r in records if r.status == "ok"]
    good = sum(1 for r in records if slo.is_good(r))
    duration = run.duration_s
    per_block = block_tokens or int(run.settings.get("block_tokens", 0))
    return Summary(
        label=run.label,
        time_scale=run.time_scale,
        offered_rps=run.offered_rps,
        duration_s=duration,
        requests=len(records),
        completed=len(done),
        rejected=sum(1 for r in records if r.status == "rejected"),
        errors=sum(1 for r in records if r.status == "error"),
        good=good,
        slo_attainment=good / len(records) if records else 0.0,
        goodput_rps=good / duration if duration > 0 else 0.0,
        throughput_rps=len(done) / duration if duration > 0 else 0.0,
        output_tokens_per_s=sum(r.output_tokens for r in done) / duration if duration > 0 else 0.0,
        prompt_tokens=sum(r.input_tokens for r in done),
        cached_tokens=sum(r.cached_tokens or 0 for r in done),
        cacheable_tokens=sum(r.cached_blocks_expected for r in done) * per_block,
        ttft=Distribution.of(r.ttft_s for r in done if r.ttft_s is not None),
        tpot=Distribution.of(r.tpot_s for r in done if r.tpot_s is not None and r.output_tokens > 1),
        itl=Distribution.of(gap for r in done for gap in r.itl_s),
        e2e=Distribution.of(r.e2e_s for r in done if r.e2e_s is not None),
        slo=slo,
    )


def goodput_at_attainment(summaries: Sequence[Summary], target: float = 0.9) -> Summary | None:
    """The run with the highest goodput among those whose SLO attainment reaches
    ``target``; None when no run does."""
    passing = [s for s in summaries if s.slo_attainment >= target]
    return max(passing, key=lambda s: s.goodput_rps, default=None)
