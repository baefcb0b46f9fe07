"""How long a starting conductor takes to learn what every instance holds: from the KV
history in JetStream (libs/common/kv_history.py, the default) against asking every
instance for a snapshot at once (what a conductor did before, and still does where
NATS has no JetStream), side by side on one nats-server, rounds alternating.

    .venv/bin/python bench/kv_catch_up.py [--instances 1024] [--blocks 1000000] [--rounds 3]

Simulated instances (another process: they hold the blocks, publish each its KV events,
then a checkpoint, then more events, and answer snapshot requests) each hold
blocks/instances random 16-byte block hashes in the device tier. The conductor side is
the conductor's own code: `CatchUp` over a `KVEventTracker` into a `KVIndex`, and the
conductor's snapshot requests (5 s timeout each), all sent at once. Each round checks
that the index ends up with every block, and counts the CPU time the instances spent
meanwhile (answering snapshots; nothing, reading from the history). Writes
bench/results/kv-catch-up.md.
"""

import argparse
import asyncio
import datetime
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from libs.common.kv_events import KVEventLog, KVEventTracker  # noqa: E402
from libs.common.nats_auth import inbox_prefix, load_credentials  # noqa: E402
from libs.common.nats_flush import flush
from libs.common.nats_server import NatsServer  # noqa: E402
from libs.protocol import schema, subjects  # noqa: E402
from libs.protocol.schema import KVSnapshotReply, KVSnapshotRequest  # noqa: E402
from libs.protocol.vocabulary import KVEventKind, KVTier  # noqa: E402
from services.conductor.app import SNAPSHOT_TIMEOUT  # noqa: E402
from services.conductor.catch_up import CatchUp  # noqa: E402
from services.conductor.index import KVIndex  # noqa: E402

EVENTS_PER_INSTANCE = 4  # 2 before the checkpoint, 2 after: the history's reader skips the first 2


async def run_instances(url: str, credentials: str, instances: int, blocks: int) -> None:
    """The simulated instances: publish the history, answer snapshots, until stdin closes."""
    nc = await nats.connect(url, **load_credentials(credentials).connect_options(), inbox_prefix=inbox_prefix("prefill"),
                            pending_size=256 << 20)  # fmt: skip
    per = blocks // instances
    logs = []
    for i in range(instances):
        log = KVEventLog(f"prefill-{i}", tiers=(KVTier.DEVICE,))
        hashes = [secrets.token_bytes(16) for _ in range(per)]
        chunk = -(-per // EVENTS_PER_INSTANCE)
        for n in range(EVENTS_PER_INSTANCE):
            log.record(KVEventKind.STORED, KVTier.DEVICE, hashes[n * chunk:(n + 1) * chunk])
            if n == EVENTS_PER_INSTANCE // 2 - 1:
                await nc.publish(subjects.kv_events(log.instance_id), schema.encode(log.take_batch()))
                await nc.publish(subjects.kv_checkpoint(log.instance_id), schema.encode(log.snapshot()))
        await nc.publish(subjects.kv_events(log.instance_id), schema.encode(log.take_batch()))
        logs.append(log)
        if i % 64 == 63:
            await flush(nc)

        async def answer(msg, log=log) -> None:
            await msg.respond(schema.encode(log.snapshot()))

        await nc.subscribe(subjects.kv_snapshot(log.instance_id), cb=answer)
    await flush(nc)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await nc.close()


class Fresh:
    """A conductor's KV state, empty."""

    def __init__(self) -> None:
        self.index = KVIndex()
        self.tracker = KVEventTracker(apply=self.index.apply_event, reset=self.index.replace)
        self.asked: list[str] = []


async def from_history(nc: nats.NATS) -> tuple[float, Fresh]:
    fresh = Fresh()
    catch_up = CatchUp(fresh.tracker, fresh.asked.append, is_alive=lambda i: True, settle_s=0.0)
    started = time.perf_counter()
    await catch_up.run(nc)
    if catch_up.stats is None:
        raise SystemExit("no KV history was read (see the log above)")
    return time.perf_counter() - started, fresh


async def from_snapshots(nc: nats.NATS, instances: int) -> tuple[float, Fresh, int]:
    fresh = Fresh()

    async def one(i: int) -> bool:
        instance_id = f"prefill-{i}"
        try:
            msg = await nc.request(subjects.kv_snapshot(instance_id), schema.encode(KVSnapshotRequest(instance_id=instance_id)),
                                   timeout=SNAPSHOT_TIMEOUT)  # fmt: skip
        except Exception:
            return False
        fresh.tracker.on_snapshot(schema.decode(msg.data, KVSnapshotReply))
        return True

    started = time.perf_counter()
    answered = await asyncio.gather(*(one(i) for i in range(instances)))
    return time.perf_counter() - started, fresh, answered.count(False)


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(server: NatsServer, args, instances_pid: int) -> list[dict]:
    conductor = load_credentials(server.credentials_file("conductor")).connect_options()
    nc = await nats.connect(f"nats://127.0.0.1:{server.port}", **conductor, inbox_prefix=inbox_prefix("conductor"),
                            pending_size=256 << 20)  # fmt: skip
    rows = []
    try:
        for round_ in range(args.rounds):
            for way in ("history", "snapshots") if round_ % 2 == 0 else ("snapshots", "history"):
                cpu_before = cpu_seconds(instances_pid)
                if way == "history":
                    seconds, fresh = await from_history(nc)
                    missed = len(fresh.asked)
                else:
                    seconds, fresh, missed = await from_snapshots(nc, args.instances)
                held = sum(len(blocks) for i in fresh.index.instances() for blocks in fresh.index.contents(i).values())
                instances_cpu = cpu_seconds(instances_pid) - cpu_before
                rows.append(dict(way=way, round=round_, seconds=seconds, blocks=held, missed=missed, cpu=instances_cpu))
                print(f"round {round_} {way:9s} {seconds:7.2f} s  {held} blocks  {missed} missed  "
                      f"instances' CPU {instances_cpu:.2f} s", flush=True)  # fmt: skip
    finally:
        await nc.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kv-catch-up.md")
    parser.add_argument("--instances-of", nargs=2, metavar=("URL", "CREDENTIALS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instances_of:
        asyncio.run(run_instances(*args.instances_of, args.instances, args.blocks))
        return
    with NatsServer() as server:
        url = f"nats://127.0.0.1:{server.port}"
        instances = subprocess.Popen(
            [sys.executable, __file__, "--instances", str(args.instances), "--blocks", str(args.blocks),
             "--instances-of", url, str(server.credentials_file("prefill"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            asyncio.run(_make_streams(server))
            instances.stdin.flush()
            if instances.stdout.readline().strip() != "ready":
                raise SystemExit("the simulated instances did not start")
            rows = asyncio.run(measure(server, args, instances.pid))
        finally:
            instances.stdin.close()
            instances.wait(30)
    write(args, rows)


async def _make_streams(server: NatsServer) -> None:
    """A first conductor makes the history's streams before the instances publish."""
    conductor = load_credentials(server.credentials_file("conductor")).connect_options()
    nc = await nats.connect(f"nats://127.0.0.1:{server.port}", **conductor, inbox_prefix=inbox_prefix("conductor"))
    fresh = Fresh()
    await CatchUp(fresh.tracker, fresh.asked.append, is_alive=lambda i: True, settle_s=0.0).run(nc)
    await nc.close()


def write(args, rows: list[dict]) -> None:
    def median(way: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["way"] == way)

    history, snapshots = median("history", "seconds"), median("snapshots", "seconds")
    command = " ".join(["python", "bench/kv_catch_up.py"] + sys.argv[1:])
    lines = [
        "# A starting conductor's KV catch-up: the KV history against a snapshot from every instance",
        "",
        f"Command: `{command}` ({datetime.date.today()}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; nats-server and the simulated instances on the same machine).",
        "",
        f"{args.instances} simulated instances holding {args.blocks:,} blocks in all. Median of {args.rounds} rounds, "
        "each way in turn:",
        "",
        "| way | seconds (median) | each round | blocks learned | instances missed | the instances' CPU s (median) |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for way, label in (("history", "KV history (JetStream)"), ("snapshots", "a snapshot from every instance")):
        mine = [r for r in rows if r["way"] == way]
        each = ", ".join(f"{r['seconds']:.2f}" for r in mine)
        lines.append(f"| {label} | {median(way, 'seconds'):.2f} | {each} | {mine[-1]['blocks']:,} | "
                     f"{max(r['missed'] for r in mine)} | {median(way, 'cpu'):.2f} |")  # fmt: skip
    lines += ["", f"The history took {history / snapshots:.2f}x the time of the snapshots.", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
