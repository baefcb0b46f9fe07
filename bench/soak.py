"""A soak: the default cluster (`kvserve up`: one worker per role, warm spares) under a
steady stream of chat requests for ``--minutes``, its decode worker killed every
``--kill-every`` seconds, and every service's resident memory sampled throughout.

Memory is compared from a warm snapshot (``--warm-minutes`` in: caches filled, every
code path run) to the end, per instance id (a killed worker's id is its restart's, so
its line shows what each new process holds, not one process's growth). Requests are
counted by outcome: completed, refused (429: admission), failed otherwise.

    .venv/bin/python bench/soak.py [--minutes 30] [--kill-every 60] [--clients 4] [--out bench/results/soak.md]
"""

import argparse
import asyncio
import datetime
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.cli.cluster import LocalCluster  # noqa: E402
from kvserve.replay.streams import ChatLoad, StreamOutcome, run_streams  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
ENV = {"KVSERVE_STORE_CAPACITY_BYTES": str(256 << 20)}
TOPICS = ["a lighthouse", "the number seven", "rain", "a small town", "coffee", "the sea", "a train", "winter"]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def prompt(i: int) -> str:
    """Mostly repeated openings (prefix hits), a varying tail, now and then a long one."""
    topic = TOPICS[i % len(TOPICS)]
    if i % 10 == 9:
        return f"Request {i}. " + " ".join(f"Write about {topic}, part {k}." for k in range(60))
    return f"Write two sentences about {topic}. Request {i}."


async def client(url: str, index: int, until: float, outcomes: list[StreamOutcome]) -> None:
    i = index
    while time.monotonic() < until:
        load = ChatLoad(url, MODEL, [prompt(i)], max_tokens=32, timeout_s=120)
        (outcome,) = await run_streams(load)
        outcomes.append(outcome)
        i += 1000
        if outcome.status == 429:
            await asyncio.sleep(0.5)  # as a client honouring a refusal would back off


def classify(o: StreamOutcome) -> str:
    if o.completed:
        return "completed"
    if o.status == 429:
        return "refused (429)"
    return f"failed ({o.status or 'no response'})"


async def soak(cluster: LocalCluster, args, samples: list[tuple[float, dict[str, float]]], kills: list[float]) -> list[StreamOutcome]:
    start = time.monotonic()
    until = start + args.minutes * 60
    outcomes: list[StreamOutcome] = []
    clients = [asyncio.create_task(client(cluster.gateway_url, k, until, outcomes)) for k in range(args.clients)]
    next_kill = start + args.kill_every
    while time.monotonic() < until:
        now = time.monotonic()
        pids = cluster.pids | {"nats-server": cluster.nats_pid}
        samples.append((now - start, {name: mb for name, pid in pids.items() if (mb := rss_mb(pid)) is not None}))
        if now >= next_kill:
            await asyncio.to_thread(cluster.kill, "decode-0")
            kills.append(now - start)
            next_kill += args.kill_every
        await asyncio.sleep(min(10.0, max(0.0, until - time.monotonic())))  # the sampling period
    await asyncio.gather(*clients)
    return outcomes


def snapshot(samples: list[tuple[float, dict[str, float]]], at: float) -> dict[str, float]:
    return min(samples, key=lambda s: abs(s[0] - at))[1]


def report(args, started: datetime.datetime, samples, kills, outcomes) -> str:
    warm_at = args.warm_minutes * 60
    warm, end = snapshot(samples, warm_at), samples[-1][1]
    counts = Counter(classify(o) for o in outcomes)
    migrated = sum(1 for o in outcomes if o.completed and o.served_by and o.served_by.get("migrations"))
    lines = [
        "# Soak: the default cluster under steady load, its decode worker killed every minute",
        "",
        f"- command: `python bench/soak.py --minutes {args.minutes:g} --kill-every {args.kill_every:g} "
        f"--clients {args.clients} --warm-minutes {args.warm_minutes:g}`",
        f"- date: {started:%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        f"- load: {args.clients} clients, each sending one streaming chat request (32 tokens, greedy, default SLO) "
        "after the last ended; one prompt in ten ~600 tokens, the rest short with repeated openings",
        f"- faults: kill -9 of decode-0 every {args.kill_every:g} s ({len(kills)} kills)",
        "",
        f"Requests: {len(outcomes)} sent; " + ", ".join(f"{n} {what}" for what, n in counts.most_common())
        + f"; {migrated} of the completed moved off a killed worker.",
        "",
        f"| instance | RSS at {args.warm_minutes:g} min (MB) | RSS at the end (MB) | change |",
        "|---|---|---|---|",
    ]
    for name in sorted(end):
        if name in warm:
            change = (end[name] - warm[name]) / warm[name] * 100
            lines.append(f"| {name} | {warm[name]:.0f} | {end[name]:.0f} | {change:+.1f}% |")
    lines += ["", "RSS over time (MB, one sample a minute):", "", "| minute | " + " | ".join(sorted(end)) + " |",
              "|---|" + "---|" * len(end)]
    for minute in range(0, int(args.minutes) + 1):
        row = snapshot(samples, minute * 60)
        lines.append(f"| {minute} | " + " | ".join(f"{row.get(name, 0):.0f}" for name in sorted(end)) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kill-every", type=float, default=60.0, metavar="SECONDS")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--warm-minutes", type=float, default=5.0, help="the warm snapshot's time (default 5)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.md")
    parser.add_argument("--log", type=Path, default=None, help="the cluster's log (default: a temporary file)")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.UTC)
    log = open(args.log or tempfile.mktemp(prefix="kvserve-soak-", suffix=".log"), "w")
    print(f"cluster log: {log.name}", flush=True)
    cluster = LocalCluster(gateway_port=0, env=ENV, log=log, supervise=True,
                           store_dir=tempfile.mkdtemp(prefix="kvserve-soak-"))  # fmt: skip
    cluster.start(timeout=300)
    samples: list[tuple[float, dict[str, float]]] = []
    kills: list[float] = []
    try:
        outcomes = asyncio.run(soak(cluster, args, samples, kills))
    finally:
        cluster.stop()
        shutil.rmtree(cluster.store_dir, ignore_errors=True)  # the run's disk tier
    text = report(args, started, samples, kills, outcomes)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
