"""A noisy neighbour on a real cluster: tenant A floods while tenant B sends a steady
trickle, against B alone and A alone, in one sitting on one `kvserve up`-shaped cluster
(1 prefill + 1 decode worker, store, a tenants file with A and B at weight 1).

The requests are the shared conversation trace's (uncapped, 8 tokens per block, at most 16
output tokens), each tenant its own window of it, scaled in time to the rates asked for:
B at ``--b-share`` of ``--capacity`` (default 25%), A at ``--a-times`` of it (default 4x).
Three phases, the same B window each time: B alone, A alone, A and B together. Reported:
each tenant's SLO attainment, goodput and TTFT percentiles per phase, A's refusals by
code, and B's p99 TTFT together against alone (the issue's target: within 1.3x, with
attainment >= 95%). ``--also KEY=VALUE`` runs the A-and-B phase once more on a new cluster
with that setting (the same prompts, a cold cache): a variant against the default, side by side.

    .venv/bin/python bench/tenants.py --out bench/results/tenants.md
"""

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.cli.bench import load_vocab  # noqa: E402
from kvserve.cli.cluster import LocalCluster  # noqa: E402
from kvserve.replay.client import Endpoint, plan, replay  # noqa: E402
from kvserve.replay.metrics import Summary, summarize  # noqa: E402
from kvserve.replay.prompts import PromptSynthesizer  # noqa: E402
from kvserve.replay.trace import load_trace  # noqa: E402
from libs.common import tenants as tenants_file  # noqa: E402
from libs.protocol.slo import SLO  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
BLOCK_TOKENS = 8
MAX_OUTPUT = 16


def trace_rate(requests, synth: PromptSynthesizer) -> float:
    """Requests per second of a trace window sent at time scale 1 (bucketed arrivals spread)."""
    span_s = max(p.record.scheduled_s for p in plan(requests, synth, 1.0, spread=True))
    return len(requests) / span_s if span_s > 0 else float("inf")


def write_tenants(path: Path) -> dict[str, str]:
    """A tenants file with A and B, each one new key; the keys, by tenant."""
    keys = {name: tenants_file.new_key() for name in ("A", "B")}
    tenants = tenants_file.Tenants(
        {name: tenants_file.Tenant(name, key_hashes=(tenants_file.hash_key(key),)) for name, key in keys.items()},
        scope_secret=tenants_file.new_secret(),
    )
    tenants_file.write(path, tenants)
    return keys


def row(phase: str, tenant: str, s: Summary) -> str:
    return (f"| {phase} | {tenant} | {s.offered_rps:.2f} | {s.requests} | {s.completed} | {s.rejected} | {s.errors} | "
            f"{s.slo_attainment:.1%} | {s.goodput_rps:.3f} | {_ms(s.ttft.p50)} / {_ms(s.ttft.p90)} / {_ms(s.ttft.p99)} |")


def variant(item: str, b: Summary, a: Summary, b_alone: Summary) -> str:
    ratio = f"{b.ttft.p99 / b_alone.ttft.p99:.2f}x" if b.ttft.p99 and b_alone.ttft.p99 else "not measured"
    return f"With {item}: B's p99 TTFT {ratio} alone, attainment {b.slo_attainment:.1%}; A's goodput {a.goodput_rps:.3f} req/s."


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--capacity", type=float, default=2.0,
                    help="the cluster's capacity in req/s on this trace (default 2.0: "
                    "bench/results/capacity-uncapped-8.md)")  # fmt: skip
    ap.add_argument("--b-share", type=float, default=0.25, help="B's rate, a share of the capacity (default 0.25)")
    ap.add_argument("--a-times", type=float, default=4.0, help="A's rate, a multiple of the capacity (default 4)")
    ap.add_argument("--seconds", type=float, default=60.0, help="each phase's length (default 60)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting for every service (repeatable), e.g. KVSERVE_FAIR_SHARE_PRESSURE=0.25")
    ap.add_argument("--also", action="append", default=[], metavar="KEY=VALUE",
                    help="run the A-and-B phase again on a cluster with this setting as well (repeatable), "
                    "e.g. KVSERVE_CONTENDED_CHUNK_TOKENS=0")  # fmt: skip
    ap.add_argument("--log", type=Path, default=None, help="keep the cluster's log here (default: not kept)")
    ap.add_argument("--out", type=Path, default=None, help="write the report here (default: print it)")
    ap.add_argument("--runs", type=Path, default=None,
                    help="write each phase's requests, one JSON file per phase and tenant, into this folder")
    args = ap.parse_args()
    slo = SLO()
    b_rate, a_rate = args.capacity * args.b_share, args.capacity * args.a_times
    b_count, a_count = max(2, round(b_rate * args.seconds)), max(2, round(a_rate * args.seconds))
    b_window = load_trace(args.trace, b_count, 0)
    a_window = load_trace(args.trace, a_count, 1000)  # another part of the trace: other prompts
    vocab = load_vocab(None)
    # each phase its own prompts (the trace's lengths, other tokens): no phase finds a cache an earlier one left
    synths = {phase: PromptSynthesizer(vocab, BLOCK_TOKENS, seed, None, MAX_OUTPUT)
              for seed, phase in enumerate(("B alone", "A alone", "A and B"), start=1)}  # fmt: skip
    b_scale = trace_rate(b_window, synths["B alone"]) / b_rate
    a_scale = trace_rate(a_window, synths["A alone"]) / a_rate
    started = datetime.datetime.now(datetime.UTC)
    load = os.getloadavg()[0]
    results: list[tuple[str, str, Summary]] = []
    refusals: dict[str, Counter] = {}
    errors: dict[str, Counter] = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-tenants-") as tmp:
        keys = write_tenants(Path(tmp) / "tenants.toml")
        log = open(args.log or Path(tmp) / "cluster.log", "w")
        env = dict(item.split("=", 1) for item in args.env)

        def run_cluster(env: dict[str, str], stores: str, phases: list[tuple[str, str, str]]) -> None:
            """Start a cluster with ``env`` and run each (phase, who, prompts) on it."""
            cluster = LocalCluster(prefill=1, decode=1, gateway_port=0, log=log, supervise=True, env=env,
                                   tenants_file=str(Path(tmp) / "tenants.toml"), store_dir=Path(tmp) / stores)  # fmt: skip
            cluster.start(timeout=180)
            try:
                run_phases(cluster, phases)
            finally:
                cluster.stop()

        def run_phases(cluster: LocalCluster, phases: list[tuple[str, str, str]]) -> None:
            endpoints = {name: Endpoint(cluster.gateway_url, cluster.model_id, api_key=key) for name, key in keys.items()}

            async def phase(name: str, who: str, prompts: str) -> None:
                synth, runs = synths[prompts], []
                if "B" in who:
                    runs.append(("B", replay(endpoints["B"], plan(b_window, synth, b_scale, spread=True),
                                             label=f"{name} B", time_scale=b_scale, progress=False)))  # fmt: skip
                if "A" in who:
                    runs.append(("A", replay(endpoints["A"], plan(a_window, synth, a_scale, spread=True),
                                             label=f"{name} A", time_scale=a_scale, progress=False)))  # fmt: skip
                done = await asyncio.gather(*(run for _, run in runs))
                for (tenant, _), run in zip(runs, done):
                    if args.runs is not None:
                        args.runs.mkdir(parents=True, exist_ok=True)
                        slug = name.replace(" ", "-").replace(",", "").replace("=", "-")
                        (args.runs / f"{slug}-{tenant}.json").write_text(json.dumps(run.to_json()))
                    results.append((name, tenant, summarize(run, slo, BLOCK_TOKENS)))
                    refusals[f"{name} {tenant}"] = Counter(r.error_code or "?" for r in run.records
                                                           if r.status == "rejected")  # fmt: skip
                    errors[f"{name} {tenant}"] = Counter((r.error or "?")[:120] for r in run.records
                                                         if r.status == "error")  # fmt: skip
                    print(row(name, tenant, results[-1][2]), flush=True)

            # a warm-up request per tenant: first-call costs are no phase's
            warm = PromptSynthesizer(vocab, BLOCK_TOKENS, 0, None, MAX_OUTPUT)
            for name in ("B", "A"):
                asyncio.run(replay(endpoints[name], plan(b_window[:1], warm, 0.0), progress=False))
            for name, who, prompts in phases:
                asyncio.run(phase(name, who, prompts))

        run_cluster(env, "stores", [("B alone", "B", "B alone"), ("A alone", "A", "A alone"),
                                    ("A and B", "AB", "A and B")])  # fmt: skip
        for i, item in enumerate(args.also):
            key, value = item.split("=", 1)
            run_cluster({**env, key: value}, f"stores-{i}", [(f"A and B, {item}", "AB", "A and B")])
    by = {(phase, tenant): s for phase, tenant, s in results}
    alone, shared = by[("B alone", "B")], by[("A and B", "B")]
    ratio = (shared.ttft.p99 / alone.ttft.p99) if alone.ttft.p99 and shared.ttft.p99 else None
    command = "python bench/tenants.py " + shlex.join(sys.argv[1:])
    lines = [
        "# A noisy neighbour on a real cluster",
        "",
        f"{started:%Y-%m-%d %H:%M} UTC on {platform.node()}, {os.cpu_count()} CPUs, load average at start {load:.2f}.",
        f"One cluster (1 prefill + 1 decode worker, store; tenants A and B at weight 1), trace "
        f"`{args.trace.name}` (uncapped, {BLOCK_TOKENS}-token blocks, at most {MAX_OUTPUT} output tokens), SLO "
        f"TTFT {slo.ttft_s * 1e3:.0f} ms, TPOT {slo.tbt_s * 1e3:.0f} ms, a cold cache in each phase (each phase's "
        f"prompts are new: the trace's lengths, other tokens). B sends {b_count} requests at "
        f"{b_rate:.2f} req/s ({args.b_share:.0%} of a capacity of {args.capacity:g} req/s); A sends {a_count} at "
        f"{a_rate:.2f} req/s ({args.a_times:g}x), from another part of the trace.",
        "",
        f"Command: `{command}`",
        "",
        "| phase | tenant | offered req/s | sent | ok | 429 | errors | SLO attained | goodput req/s | TTFT p50 / p90 / p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *(row(phase, tenant, s) for phase, tenant, s in results),
        "",
        "Refusals by code: " + "; ".join(f"{k}: {dict(v) or 'none'}" for k, v in refusals.items()),
        "",
        "Errors: " + "; ".join(f"{k}: {dict(v) or 'none'}" for k, v in errors.items()),
        "",
        "B's p99 TTFT with A flooding against B alone: "
        + (f"{ratio:.2f}x" if ratio is not None else "not measured") + " (target: within 1.3x); B's attainment "
        f"with A: {shared.slo_attainment:.1%} (target: >= 95%); A alone: goodput "
        f"{by[('A alone', 'A')].goodput_rps:.3f} req/s.",
        *(variant(item, by[(f"A and B, {item}", "B")], by[(f"A and B, {item}", "A")], alone) for item in args.also),
    ]
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
