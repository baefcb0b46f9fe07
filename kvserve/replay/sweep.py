"""One trace window replayed at several time scales against one endpoint, and
the files a replay leaves: a JSON file per run (every request, plus its
summary), ``summary.md``, ``ttft_cdf.png`` and, for several runs,
``goodput_vs_load.png``; and a capacity search's probes (``capacity_measure``)
with ``capacity.md`` and ``capacity.png``.

Run ``i`` of a sweep (probe ``i`` of a capacity search) synthesizes its prompts with seed ``seed + i``: the same
lengths and the same sharing, but different tokens, so a run never finds the
previous run's prompts in the server's cache and the runs can share one server.
With ``SweepSettings.history`` (the trace before the window), each run first
warms, with its own seed, the prefixes the window shares with that history
(``history.warm``).
"""

import asyncio
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.replay import history, plots, report
from kvserve.replay.capacity import Capacity, Measure, Probe
from kvserve.replay.client import Endpoint, plan, replay
from kvserve.replay.metrics import Summary, summarize
from kvserve.replay.prompts import PromptSynthesizer
from kvserve.replay.records import Run
from kvserve.replay.trace import TraceRequest, arrival_offsets_ms
from libs.protocol.errors import KVServeError
from libs.protocol.slo import SLO


@dataclass(frozen=True)
class SweepSettings:
    vocab: Sequence[int]
    time_scales: Sequence[float]
    block_tokens: int = 16
    seed: int = 0
    max_input: int | None = None
    max_output: int | None = None
    spread: bool = False  # spread same-timestamp requests over their bucket (see trace.arrival_offsets_ms)
    slo: SLO = SLO()
    history: Sequence[TraceRequest] = ()  # the trace before the window: each run first warms what it shares with it


def run_sweep(
    endpoint: Endpoint,
    requests: Sequence[TraceRequest],
    settings: SweepSettings,
    *,
    label: str,
    out_dir: Path | None = None,
    trace_name: str = "",
    progress: bool = True,
) -> list[tuple[Run, Summary]]:
    results = []
    prefixes = history.shared_prefixes(settings.history, requests, _synth(settings, settings.seed))
    for i, scale in enumerate(settings.time_scales):
        seed = settings.seed + i
        synth = _synth(settings, seed)
        warming = asyncio.run(history.warm(endpoint, prefixes, synth)) if settings.history else None
        if warming and warming.failed:
            print(f"{label}: {warming.failed} of {warming.prompts} warming prompts failed", file=sys.stderr)
        planned = plan(requests, synth, scale, settings.spread, warmed=prefixes)
        meta = {
            "trace": trace_name,
            "first_request": min(r.index for r in requests),
            "num_requests": len(requests),
            "block_tokens": settings.block_tokens,
            "seed": seed,
            "max_input": settings.max_input,
            "max_output": settings.max_output,
            "spread": settings.spread,
            "model": endpoint.model,
            "loadavg_before": os.getloadavg()[0],
            "history_requests": len(settings.history),
            **(warming.to_json() if warming else {}),
            "started_at": time.time(),
        }
        run = asyncio.run(replay(endpoint, planned, label=label, time_scale=scale, settings=meta, progress=progress))
        run.settings["loadavg_after"] = os.getloadavg()[0]  # the 1-minute average: was the machine ours?
        summary = summarize(run, settings.slo, settings.block_tokens)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            repeated = list(settings.time_scales).count(scale) > 1  # one file per run all the same
            name = f"{_slug(label)}-x{scale:g}" + (f"-seed{seed}" if repeated else "")
            run.save(out_dir / f"{name}.json", summary.to_json())
        results.append((run, summary))
    return results


def _synth(settings: SweepSettings, seed: int) -> PromptSynthesizer:
    return PromptSynthesizer(settings.vocab, settings.block_tokens, seed, settings.max_input, settings.max_output)


def write_outputs(results: Sequence[tuple[Run, Summary]], out_dir: Path, title: str = "Trace replay") -> list[Path]:
    """summary.md and the plots for ``results`` (runs of any labels), in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [run for run, _ in results]
    summaries = [summary for _, summary in results]
    written = [out_dir / "summary.md"]
    written[0].write_text(report.markdown(summaries, title))
    written.append(plots.ttft_cdf(runs, out_dir / "ttft_cdf.png", summaries[0].slo.ttft_s * 1e3))
    if len(results) > 1:
        written.append(plots.goodput_vs_load(summaries, out_dir / "goodput_vs_load.png"))
    return written


def unit_offered_rps(requests: Sequence[TraceRequest], spread: bool = False) -> float:
    """The window's offered rate at time scale 1 (``Run.offered_rps``'s definition);
    a rate needs at least two arrivals that are not simultaneous."""
    offsets = arrival_offsets_ms(list(requests), spread)
    span_s = (max(offsets.values()) - min(offsets.values())) / 1000.0
    if span_s <= 0:
        count = f"{len(requests)} request{'s' if len(requests) != 1 else ''}"
        raise KVServeError(
            f"this trace window's arrivals span no time ({count}): a load search needs arrivals spread over "
            f"time ({'a longer window' if spread else 'a longer window, or --spread'})"
        )
    return (len(requests) - 1) / span_s


def capacity_measure(
    endpoint: Endpoint,
    requests: Sequence[TraceRequest],
    settings: SweepSettings,
    *,
    label: str,
    out_dir: Path | None = None,
    trace_name: str = "",
    progress: bool = True,
) -> Measure:
    """A capacity search's probe: the window replayed once at the time scale asked,
    probe ``i`` with prompt seed ``settings.seed + i``."""
    unit_rps = unit_offered_rps(requests, settings.spread)

    def measure(time_scale: float, probe: int) -> Probe:
        one = replace(settings, time_scales=[time_scale], seed=settings.seed + probe)
        [(_, summary)] = run_sweep(
            endpoint, requests, one, label=label, out_dir=out_dir, trace_name=trace_name, progress=progress
        )
        offered = summary.offered_rps if summary.offered_rps is not None else unit_rps / time_scale
        return Probe(time_scale, offered, summary.slo_attainment, summary.goodput_rps, summary)

    return measure


def write_capacity_outputs(capacity: Capacity, slo: SLO, out_dir: Path, title: str = "Capacity search") -> list[Path]:
    """capacity.md and capacity.png for one search, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "capacity.md"
    md.write_text(report.capacity_markdown(capacity, slo, title))
    return [md, plots.capacity_curves([capacity], out_dir / "capacity.png")]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "run"
