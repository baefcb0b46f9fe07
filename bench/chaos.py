"""Faults under load: what each one costs the clients of a local cluster, and how long
the cluster takes to serve normally again.

For every fault, 40 clients stream greedy chat completions at once from a
`kvserve up --prefill 2 --decode 2` cluster (the same supervised LocalCluster), and
the fault is injected mid-stream. Each stream is counted as completed (ended with
[DONE] and a normal finish), migrated (completed, but served by more than one
worker), errored (an error event, then [DONE], or an HTTP error) or broken/hung
(cut without either, or no end within the client's limit). Recovery is the time from
the fault to the first probe request that succeeds once the killed process (if any)
has reported in again. Faults:

- kill -9 of a decode worker, a prefill worker, the store (supervised);
- kill -9 of a decode worker without supervision (as under docker compose);
- kill -9 of nats-server (supervised: restarted on its port);
- kill -9 of `kvserve up` itself (every child must be gone within 5 s).

    .venv/bin/python bench/chaos.py [--streams 40] [--max-tokens 48] [--out bench/results/chaos.md]
"""

import argparse
import asyncio
import datetime
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.cli.cluster import LocalCluster  # noqa: E402
from kvserve.replay.streams import ChatLoad, StreamOutcome, run_streams, tally  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
ENV = {"KVSERVE_NUM_BLOCKS": "256", "KVSERVE_STORE_CAPACITY_BYTES": str(128 << 20)}


@dataclass
class Row:
    fault: str
    outcomes: list[StreamOutcome]
    recovery_s: float | None
    note: str = ""


def prompts(n: int, salt: str) -> list[str]:
    return [f"{salt} Write one sentence about the number {i}." for i in range(n)]


async def probe_until_served(base_url: str, since: float, ready: "asyncio.Future[None] | None", limit_s: float) -> float | None:
    """Seconds from ``since`` to the first successful short request sent after ``ready`` resolved."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 2, "temperature": 0}
    deadline = since + limit_s
    async with aiohttp.ClientSession() as session:
        if ready is not None:
            await asyncio.wait_for(ready, timeout=max(0.1, deadline - time.monotonic()))
        while time.monotonic() < deadline:
            try:
                async with session.post(base_url + "/v1/chat/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=10)) as response:  # fmt: skip
                    if response.status == 200:
                        await response.read()
                        return time.monotonic() - since
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.2)  # a probe every 200 ms until one succeeds
    return None


def back_in_service(cluster: LocalCluster, victim: str | None, killed_wall: float) -> "asyncio.Future[None]":
    """Resolves once ``victim`` has sent a heartbeat from a process started after the kill."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def wait() -> None:
        try:
            if victim is not None:
                cluster.wait_for(lambda hbs: victim in hbs and hbs[victim].started_at > killed_wall, timeout=120)
            else:
                cluster.wait_for(lambda hbs: all(i in hbs for i in cluster.instance_ids), timeout=120)
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(None))
        except TimeoutError as e:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_exception(e))

    loop.run_in_executor(None, wait)
    return future


def idle(cluster: LocalCluster) -> None:
    def check(hbs) -> bool:
        workers = [hb for hb in hbs.values() if hb.role in ("prefill", "decode")]
        return set(cluster.instance_ids) <= hbs.keys() and all(hb.load == 0 for hb in workers)

    cluster.wait_for(check, timeout=120)


async def kill_under_load(cluster: LocalCluster, victim: str, after: int, args, salt: str, restarts: bool) -> Row:
    idle(cluster)
    load = ChatLoad(cluster.gateway_url, MODEL, prompts(args.streams, salt), max_tokens=args.max_tokens, timeout_s=120)
    started = asyncio.Event()
    streams = asyncio.create_task(run_streams(load, started, started_after=after))
    await asyncio.wait_for(started.wait(), timeout=120)
    killed_mono, killed_wall = time.monotonic(), time.time()
    if victim == "nats-server":
        os.kill(cluster.nats_pid, signal.SIGKILL)
        ready = back_in_service(cluster, None, killed_wall)
    else:
        await asyncio.to_thread(cluster.kill, victim)
        ready = back_in_service(cluster, victim, killed_wall) if restarts else None
    recovery = asyncio.create_task(probe_until_served(cluster.gateway_url, killed_mono, ready, limit_s=120))
    outcomes = await streams
    try:
        recovery_s = await recovery
    except TimeoutError:
        recovery_s = None
    note = "" if restarts else f"{victim} stays down: recovery is the first request served by the workers left"
    return Row(f"kill -9 {victim}" + ("" if restarts else " (no supervisor)"), outcomes, recovery_s, note)


def start(supervise: bool, log) -> LocalCluster:
    cluster = LocalCluster(
        prefill=2, decode=2, gateway_port=0, dtype="auto", env=ENV, log=log, supervise=supervise,
        store_dir=tempfile.mkdtemp(prefix="kvserve-chaos-"),
    )  # fmt: skip
    cluster.start(timeout=300)
    return cluster


def kill_the_launcher(args) -> Row:
    env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli.main", "up", "--port", "0", "--prefill", "2", "--decode", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    url = None
    for line in proc.stdout:
        if match := re.search(r"kvserve is up: (http://127\.0\.0\.1:\d+)/v1", line):
            url = match.group(1)
            break
    if url is None:
        raise SystemExit("kvserve up exited before printing its URL")
    children = descendants(proc.pid)

    async def scenario() -> list[StreamOutcome]:
        load = ChatLoad(url, MODEL, prompts(args.streams, "launcher"), max_tokens=args.max_tokens, timeout_s=60)
        started = asyncio.Event()
        streams = asyncio.create_task(run_streams(load, started, started_after=args.streams // 2))
        await asyncio.wait_for(started.wait(), timeout=120)
        proc.kill()
        return await streams

    outcomes = asyncio.run(scenario())
    proc.wait()
    killed = time.monotonic()
    while any(alive(p) for p in children) and time.monotonic() - killed < 5:
        time.sleep(0.05)  # polling /proc until the children are gone, 5 s at most
    left = [p for p in children if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    proc.stdout.close()
    note = f"{len(children)} child processes; {len(left)} still running 5 s after the kill"
    return Row("kill -9 kvserve up", outcomes, None, note)


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            todo += [c for c in children if c not in found]
            found.update(children)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def report(rows: list[Row], args, started: datetime.datetime, took_s: float) -> str:
    lines = [
        "# Chaos: faults under 40 concurrent streams",
        "",
        f"- command: `python bench/chaos.py --streams {args.streams} --max-tokens {args.max_tokens}`",
        f"- date: {started:%Y-%m-%d %H:%M} UTC (took {took_s:.0f} s)",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- cluster: `kvserve up --prefill 2 --decode 2` (supervised LocalCluster, dtype auto), "
        f"{args.streams} greedy streaming chat requests of up to {args.max_tokens} tokens per fault, "
        "each fault injected once the first tokens are out",
        "",
        "| fault | sent | completed | of which migrated | errored ([DONE] after an error event) | broken or hung | "
        "longest client silence | serving normally again after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t = tally(row.outcomes)
        recovery = "n/a" if row.recovery_s is None else f"{row.recovery_s:.1f} s"
        lines.append(
            f"| {row.fault} | {t.sent} | {t.completed} | {t.migrated} | {t.errored} | {t.broken} | "
            f"{t.max_silence_s:.1f} s | {recovery} |"
        )
    notes = [f"- {row.fault}: {row.note}" for row in rows if row.note]
    errors = sorted({(row.fault, o.error[:120]) for row in rows for o in row.outcomes if o.error})
    if notes:
        lines += ["", *notes]
    if errors:
        lines += ["", "Errors the clients saw (distinct messages):", ""]
        lines += [f"- {fault}: {message}" for fault, message in errors]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "chaos.md")
    parser.add_argument("--log", type=Path, default=None, help="the clusters' logs (default: a temporary file)")
    args = parser.parse_args()
    started, t0 = datetime.datetime.now(datetime.UTC), time.monotonic()
    log = open(args.log or tempfile.mktemp(prefix="kvserve-chaos-", suffix=".log"), "w")
    print(f"cluster logs: {log.name}")
    rows = []
    cluster = start(supervise=True, log=log)
    try:
        for victim, after in (("decode-0", args.streams), ("prefill-1", args.streams // 5),
                              ("store-0", args.streams // 2), ("nats-server", args.streams)):  # fmt: skip
            rows.append(asyncio.run(kill_under_load(cluster, victim, after, args, victim, restarts=True)))
            print(rows[-1].fault, tally(rows[-1].outcomes).line(), f"recovery {rows[-1].recovery_s}", flush=True)
    finally:
        cluster.stop()
    cluster = start(supervise=False, log=log)
    try:
        rows.append(asyncio.run(kill_under_load(cluster, "decode-0", args.streams, args, "unsupervised", restarts=False)))
        print(rows[-1].fault, tally(rows[-1].outcomes).line(), flush=True)
    finally:
        cluster.stop()
    rows.append(kill_the_launcher(args))
    print(rows[-1].fault, tally(rows[-1].outcomes).line(), rows[-1].note, flush=True)
    text = report(rows, args, started, time.monotonic() - t0)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
