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
- Attainment among admitted: good requests over those not refused (sent - 429s):
  how the requests a server took on fared, apart from how many it turned away.
- A refusal was made *while idle* when, at the moment its 429 arrived, no other
  request of the run was waiting for its first token (sent, and neither its first
  token nor its end had arrived). The client being the only load, a server with
  one prefill worker then had nothing queued for it. *Near idle* (``NEAR_IDLE_S``):
  every request waiting then had its first token at most that much later, about
  what one 256-token prefill chunk takes on a 2-core machine: the server's queue
  was about to empty (these include the ones while idle).
- Prompt-size bands split all of these by the prompt length as sent (``BANDS``).
"""

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvserve.replay.records import RequestRecord, Run
from libs.common.prefill_order import BAND_NAMES
from libs.common.prefill_order import band_of as band_index
from libs.protocol.slo import SLO

PERCENTILES = (50, 90, 99)
NEAR_IDLE_S = 0.25  # a refusal this close before the server went idle is counted as near idle
UNATTAINABLE = "slo_unattainable"  # a 429 for a request that misses its SLO even on an idle server

# (name, smallest prompt length, first length past the band) in prompt tokens as sent
BANDS = BAND_NAMES  # the prompt-size bands admission learns its slack per (libs/common/prefill_order.py)


def band_of(input_tokens: int) -> str:
    """The name of the prompt-size band a prompt of ``input_tokens`` tokens falls in."""
    return BAND_NAMES[band_index(input_tokens)]


def is_good(record: RequestRecord, slo: SLO) -> bool:
    """Whether a request succeeded within both targets."""
    return record.status == "ok" and slo.met(record.ttft_s, record.tpot_s)


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
class BandSummary:
    """One prompt-size band of a run. Ratios are None when their denominator is 0."""

    band: str
    requests: int
    completed: int
    rejected: int
    errors: int
    good: int
    slo_attainment: float | None  # good / requests
    admitted_attainment: float | None  # good / (requests - rejected)
    rejected_while_idle: int | None  # None when the records lack the times it needs (older files)
    ttft: Distribution  # of completed requests


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
    admitted_attainment: float | None = None  # good / (requests - rejected); None when every request was refused
    rejected_while_idle: int | None = None  # None when the records lack the times it needs (older files)
    rejected_unattainable: int = 0  # refused as unable to meet the SLO even alone (code slo_unattainable)
    rejected_near_idle: int | None = None  # within NEAR_IDLE_S of idle, the idle ones included; None as above
    bands: tuple[BandSummary, ...] = ()  # one per BANDS entry, in its order

    def to_json(self) -> dict:
        return asdict(self) | {"slo": {"ttft_ms": self.slo.ttft_s * 1e3, "tpot_ms": self.slo.tbt_s * 1e3}}


def summarize(run: Run, slo: SLO, block_tokens: int | None = None) -> Summary:
    """Reduce one run. ``block_tokens`` turns expected cached blocks into tokens."""
    records = run.records
    done, counts = _counts(records, slo)
    good, rejected = counts["good"], counts["rejected"]
    idle, near = rejected_while_idle(records), rejected_while_idle(records, within_s=NEAR_IDLE_S)
    duration = run.duration_s
    per_block = block_tokens or int(run.settings.get("block_tokens", 0))
    return Summary(
        label=run.label,
        time_scale=run.time_scale,
        offered_rps=run.offered_rps,
        duration_s=duration,
        **counts,
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
        admitted_attainment=_ratio(good, len(records) - rejected),
        rejected_while_idle=None if idle is None else len(idle),
        rejected_unattainable=sum(1 for r in records if r.status == "rejected" and r.error_code == UNATTAINABLE),
        rejected_near_idle=None if near is None else len(near),
        bands=tuple(_band(name, records, slo, idle) for name in BANDS),
    )


def rejected_while_idle(records: Sequence[RequestRecord], within_s: float = 0.0) -> list[RequestRecord] | None:
    """The refusals that arrived while no other request of ``records`` was waiting for
    its first token, or (``within_s``) while every one waiting had it at most that much
    later; None when a record lacks the end time this needs (older files).
    A request waits from its send until its first token or its end, whichever is first.
    A refusal saying the request cannot meet its SLO even alone (``slo_unattainable``)
    is no refusal of a request the idle server could have served, and is not counted."""
    refused = [r for r in records if r.status == "rejected" and r.error_code != UNATTAINABLE]
    if not refused:
        return []
    waits = []
    for r in records:
        end = r.end_at_s
        if end is None:
            return None
        first = r.first_token_at_s
        waits.append((r, r.start_s, end if first is None else min(first, end)))
    return [
        refusal for refusal in refused
        if not any(other is not refusal and sent <= refusal.end_at_s and refusal.end_at_s + within_s < until
                   for other, sent, until in waits)
    ]  # fmt: skip


def _band(name: str, records: Sequence[RequestRecord], slo: SLO, idle: list[RequestRecord] | None) -> BandSummary:
    members = [r for r in records if band_of(r.input_tokens) == name]
    done, counts = _counts(members, slo)
    good, rejected = counts["good"], counts["rejected"]
    return BandSummary(
        band=name,
        **counts,
        slo_attainment=_ratio(good, len(members)),
        admitted_attainment=_ratio(good, len(members) - rejected),
        rejected_while_idle=None if idle is None else sum(1 for r in idle if band_of(r.input_tokens) == name),
        ttft=Distribution.of(r.ttft_s for r in done if r.ttft_s is not None),
    )


def _counts(records: Sequence[RequestRecord], slo: SLO) -> tuple[list[RequestRecord], dict[str, int]]:
    """The completed records, and the counts a summary and a band share: requests,
    completed, rejected, errors and good (met both SLOs)."""
    done = [r for r in records if r.status == "ok"]
    return done, {
        "requests": len(records),
        "completed": len(done),
        "rejected": sum(1 for r in records if r.status == "rejected"),
        "errors": sum(1 for r in records if r.status == "error"),
        "good": sum(1 for r in records if is_good(r, slo)),
    }


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def goodput_at_attainment(summaries: Sequence[Summary], target: float = 0.9) -> Summary | None:
    """The run with the highest goodput among those whose SLO attainment reaches
    ``target``; None when no run does."""
    passing = [s for s in summaries if s.slo_attainment >= target]
    return max(passing, key=lambda s: s.goodput_rps, default=None)
