"""Faults under load: what each one costs the clients of a local cluster, and how long
the cluster takes to serve normally again.

For every fault, 40 clients stream greedy chat completions at once from a cluster in
the default shape (`kvserve up`: one prefill and one decode worker) and again from
`kvserve up --prefill 2 --decode 2` (the same supervised LocalCluster), and the fault
is injected mid-stream; one more request is sent at the moment of the kill. Each stream is counted as completed (ended with
[DONE] and a normal finish), migrated (completed, but served by more than one
worker), errored (an error event, then [DONE], or an HTTP error) or broken/hung
(cut without either, or no end within the client's limit). Recovery is the time from
the fault to the first probe request that succeeds once the killed process (if any)
has reported in again; "a request sent at the kill" is that one request's time to its
last byte. Faults:

- kill -9 of a decode worker, a prefill worker, the store (supervised);
- kill -9 of a decode worker without supervision (as under docker compose; two per role
  only: with one decode worker nothing is left to serve);
- kill -9 of nats-server (supervised: restarted on its port);
- kill -9 of `kvserve up` itself (every child must be gone within 5 s).

    .venv/bin/python bench/chaos.py [--shape default|two|both] [--streams 40] [--max-tokens 48] [--out bench/results/chaos.md]
"""

import argparse
import asyncio
import datetime
import os
import platform
import re
import shutil
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
# The 40 streams come at once, more than one prefill worker can start within the 2 s TTFT
# target and more than one decode worker can hold within the 150 ms TBT target: every
# request carries targets of 60 s and 10 s, so admission takes them all and the faults are
# what is measured (with the default SLO, a request at the kill is refused for the load).
RELAXED_SLO = {"x-kvserve-slo-ttft-ms": "60000", "x-kvserve-slo-tbt-ms": "10000"}


SHAPES = {"default": (1, 1), "two": (2, 2)}  # prefill and decode workers


@dataclass
class Row:
    shape: str
    fault: str
    outcomes: list[StreamOutcome]
    recovery_s: float | None
    at_kill: StreamOutcome | None = None  # the request sent at the moment of the kill
    note: str = ""
    reference: list[str] | None = None  # each prompt's greedy text from an undisturbed run

    def equal(self, migrated: bool) -> tuple[int, int]:
        """Completed streams (migrated or not) whose text equals the undisturbed run's: (equal, of)."""
        if self.reference is None:
            return 0, 0
        chosen = [o for o in self.outcomes if o.completed and bool(o.served_by and o.served_by.get("migrations")) == migrated]
        return sum(o.text == self.reference[o.index] for o in chosen), len(chosen)


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
                async with session.post(base_url + "/v1/chat/completions", json=body, headers=RELAXED_SLO,
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
            loop.call_soon_threadsafe(lambda error=e: future.done() or future.set_exception(error))

    loop.run_in_executor(None, wait)
    return future


def idle(cluster: LocalCluster) -> None:
    def check(hbs) -> bool:
        workers = [hb for hb in hbs.values() if hb.role in ("prefill", "decode")]
        return set(cluster.instance_ids) <= hbs.keys() and all(hb.load == 0 for hb in workers)

    cluster.wait_for(check, timeout=120)


def chat_load(url: str, args, salt: str) -> ChatLoad:
    return ChatLoad(url, MODEL, prompts(args.streams, salt), max_tokens=args.max_tokens, timeout_s=120, headers=RELAXED_SLO)


async def undisturbed(cluster: LocalCluster, args, salt: str) -> list[str]:
    """Each prompt's greedy text, with nothing killed (the reference a moved stream must equal)."""
    idle(cluster)
    outcomes = await run_streams(chat_load(cluster.gateway_url, args, salt))
    if not all(o.completed for o in outcomes):
        raise SystemExit(f"the undisturbed run failed: {tally(outcomes).line()}")
    return [o.text for o in outcomes]


async def kill_under_load(cluster: LocalCluster, shape: str, victim: str, after: int, args, salt: str, restarts: bool) -> Row:
    idle(cluster)
    cluster.wait_for_spares(timeout=120)  # as a cluster that has run a while has them
    load = chat_load(cluster.gateway_url, args, salt)
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
    at_kill = asyncio.create_task(
        run_streams(ChatLoad(cluster.gateway_url, MODEL, prompts(1, salt + " at the kill"), max_tokens=8, timeout_s=120,
                             headers=RELAXED_SLO))  # fmt: skip
    )
    recovery = asyncio.create_task(probe_until_served(cluster.gateway_url, killed_mono, ready, limit_s=120))
    outcomes = await streams
    (new,) = await at_kill
    try:
        recovery_s = await recovery
    except TimeoutError:
        recovery_s = None
    note = "" if restarts else f"{victim} stays down: recovery is the first request served by the workers left"
    return Row(shape, f"kill -9 {victim}" + ("" if restarts else " (no supervisor)"), outcomes, recovery_s, new, note)


def start(shape: str, supervise: bool, log, args) -> LocalCluster:
    prefill, decode = SHAPES[shape]
    cluster = LocalCluster(
        prefill=prefill, decode=decode, gateway_port=0, dtype=args.dtype, env=ENV, log=log, supervise=supervise,
        store_dir=tempfile.mkdtemp(prefix="kvserve-chaos-"),
    )  # fmt: skip
    cluster.start(timeout=300)
    return cluster


def kill_the_launcher(args) -> Row:
    env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli.main", "up", "--port", "0"],
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
        load = ChatLoad(url, MODEL, prompts(args.streams, "launcher"), max_tokens=args.max_tokens, timeout_s=60,
                        headers=RELAXED_SLO)  # fmt: skip
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
    return Row("default", "kill -9 kvserve up", outcomes, None, note=note)


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
        f"- command: `python bench/chaos.py --shape {args.shape} --dtype {args.dtype} --streams {args.streams} "
        f"--max-tokens {args.max_tokens}`",
        f"- date: {started:%Y-%m-%d %H:%M} UTC (took {took_s:.0f} s)",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- clusters: {' and '.join(SHAPE_COMMANDS[shape] for shape in shapes_of(args))} "
        f"(supervised LocalCluster, dtype {args.dtype}), {args.streams} greedy streaming chat requests of up to "
        f"{args.max_tokens} tokens per fault, each fault injected once the first tokens are out, and one more request of 8 tokens "
        "sent at the kill; every request with SLO targets of 60 s TTFT and 10 s TBT, so admission refuses none; "
        "every kill after the warm spares are ready",
        "",
        "| shape | fault | sent | completed | of which migrated | errored ([DONE] after an error event) | broken or hung | "
        "longest client silence | a request sent at the kill | serving normally again after | "
        "greedy text as undisturbed: migrated | not migrated |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t = tally(row.outcomes)
        recovery = "n/a" if row.recovery_s is None else f"{row.recovery_s:.1f} s"
        lines.append(
            f"| {SHAPE_NAMES[row.shape]} | {row.fault} | {t.sent} | {t.completed} | {t.migrated} | {t.errored} | "
            f"{t.broken} | {t.max_silence_s:.1f} s | {at_kill(row.at_kill)} | {recovery} | "
            f"{fraction(*row.equal(True))} | {fraction(*row.equal(False))} |"
        )
    notes = [f"- {row.fault}: {row.note}" for row in rows if row.note]
    errors = sorted({(SHAPE_NAMES[row.shape] + ", " + row.fault, o.error[:120])
                     for row in rows for o in row.outcomes + ([row.at_kill] if row.at_kill else []) if o.error})
    if notes:
        lines += ["", *notes]
    if errors:
        lines += ["", "Errors the clients saw (distinct messages):", ""]
        lines += [f"- {fault}: {message}" for fault, message in errors]
    return "\n".join(lines) + "\n"


SHAPE_NAMES = {"default": "1+1", "two": "2+2"}
SHAPE_COMMANDS = {"default": "`kvserve up` (the default: one prefill and one decode worker)",
                  "two": "`kvserve up --prefill 2 --decode 2`"}  # fmt: skip


def shapes_of(args) -> tuple[str, ...]:
    return ("default", "two") if args.shape == "both" else (args.shape,)


def fraction(equal: int, of: int) -> str:
    return "n/a" if of == 0 else f"{equal}/{of}"


def at_kill(outcome: StreamOutcome | None) -> str:
    if outcome is None:
        return "n/a"
    if not outcome.completed:
        return f"failed ({outcome.status})"
    return f"{outcome.ended_at - outcome.started_at:.1f} s"


def run_shape(shape: str, args, log) -> list[Row]:
    prefill, decode = SHAPES[shape]
    rows = []
    victims = [("decode-0", args.streams), (f"prefill-{prefill - 1}", args.streams // 5),
               ("store-0", args.streams // 2), ("nats-server", args.streams)]  # fmt: skip
    cluster = start(shape, supervise=True, log=log, args=args)
    try:
        # the same prompts every time: a moved stream's text is compared with an undisturbed run's
        reference = asyncio.run(undisturbed(cluster, args, shape))
        for victim, after in victims:
            row = asyncio.run(kill_under_load(cluster, shape, victim, after, args, shape, restarts=True))
            row.reference = reference
            rows.append(row)
            print(shape, row.fault, tally(row.outcomes).line(), f"at the kill {at_kill(row.at_kill)}",
                  f"recovery {row.recovery_s}", "equal migrated", row.equal(True), "not", row.equal(False),
                  flush=True)  # fmt: skip
    finally:
        cluster.stop()
        shutil.rmtree(cluster.store_dir, ignore_errors=True)  # the run's disk tier
    if decode > 1:
        cluster = start(shape, supervise=False, log=log, args=args)
        try:
            row = asyncio.run(kill_under_load(cluster, shape, "decode-0", args.streams, args, "unsupervised", restarts=False))
            rows.append(row)
            print(shape, row.fault, tally(row.outcomes).line(), flush=True)
        finally:
            cluster.stop()
            shutil.rmtree(cluster.store_dir, ignore_errors=True)  # the run's disk tier
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("default", "two", "both"), default="both",
                        help="one worker per role (kvserve up's default), two per role, or both (default)")
    parser.add_argument("--dtype", default="auto", help="the workers' dtype (default auto, as kvserve up)")
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "chaos.md")
    parser.add_argument("--log", type=Path, default=None, help="the clusters' logs (default: a temporary file)")
    args = parser.parse_args()
    started, t0 = datetime.datetime.now(datetime.UTC), time.monotonic()
    log = open(args.log or tempfile.mktemp(prefix="kvserve-chaos-", suffix=".log"), "w")
    print(f"cluster logs: {log.name}")
    rows = []
    for shape in shapes_of(args):
        rows += run_shape(shape, args, log)
    rows.append(kill_the_launcher(args))
    print(rows[-1].fault, tally(rows[-1].outcomes).line(), rows[-1].note, flush=True)
    text = report(rows, args, started, time.monotonic() - t0)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
