"""The store against Mooncake Store and against the raw disk, side by side in one run.

    .venv/bin/python bench/store.py [--total-mib 256] [--out bench/results/store.md]

Runs itself inside a private network namespace (`unshare -n`, only `lo` up),
because Mooncake's master, metadata and data listeners bind every interface.
For each block size (4 KiB, 1 MiB, 16 MiB) it starts the servers as their own
processes and drives them from this process, the client:

- kvserve: one `services.store` instance (a synthetic KV contract whose block is
  the size measured), batched two-phase puts and gets through the transfer
  engine, shared memory (same host) and TCP (forced); DRAM hits, then disk hits
  on a second instance whose DRAM holds two batches (the page cache dropped
  first when this runs as root);
- Mooncake Store (`mooncake-transfer-engine-non-cuda`): `mooncake_master` on
  127.0.0.1, a holder process mounting the global segment, P2PHANDSHAKE, tcp;
  this process puts from and gets into a registered buffer, batched the same way;
- raw disk: a sequential read of the very files the disk-tier gets read.

Writes a markdown table to --out (and prints it).
"""

import argparse
import asyncio
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIB = 1 << 20
SIZES = (4096, MIB, 16 * MIB)
MASTER_PORT = 50051


# --- servers (run as their own processes) ---------------------------------------------------
def serve_kvserve(args) -> None:
    from libs.common.service import configure_logging, run_service
    from services.store.app import StoreService
    from services.store.settings import StoreSettings

    configure_logging(args.instance, "WARNING")
    settings = StoreSettings(role="store", nats_url=args.nats, instance_id=args.instance, host_id="bench-host",
                             heartbeat_interval=0.2, nats_credentials=os.environ["KVSERVE_NATS_CREDENTIALS"],
                             directory=Path(args.dir), capacity_bytes=args.capacity, disk_bytes=args.disk)  # fmt: skip
    run_service(StoreService(settings, bench_contract(args.block_bytes), args.block_bytes))


def bench_contract(block_bytes: int):
    from libs.protocol.schema import KVContract

    return KVContract(model_id="bench", block_size=1, layout=f"bench:{block_bytes}B", hash_scheme="bench")


def serve_mooncake(args) -> None:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", args.segment, 16 * MIB, "tcp", "", f"127.0.0.1:{MASTER_PORT}")
    print(f"ready {rc}", flush=True)
    sys.stdin.read()  # until the client closes our stdin
    store.close()


# --- kvserve client ------------------------------------------------------------------------------
async def kvserve_run(nats, block: int, count: int, batch: int, transport: str, disk: bool, workdir: Path):
    """Put ``count`` blocks, then get them: DRAM hits, or (``disk``) disk hits. ``nats``: a NatsServer."""
    from tests.integration.store_harness import Caller

    instance = f"bench-{'disk' if disk else 'dram'}-{transport}-{block}"
    directory = workdir / instance
    slots = 2 * batch if disk else count
    capacity = slots * block
    disk_bytes = (count + 1) * (block + 64) if disk else 0
    server = subprocess.Popen([sys.executable, __file__, "serve-kvserve", "--nats", nats.public_url, "--instance",
                               instance, "--block-bytes", str(block), "--capacity", str(capacity), "--disk",
                               str(disk_bytes), "--dir", str(directory)],
                              env=dict(os.environ, KVSERVE_NATS_CREDENTIALS=str(nats.credentials_file("store"))))  # fmt: skip
    try:
        caller = Caller(nats.url, bench_contract(block), block, num_blocks=batch)
        caller.transfers.host_id = "bench-host" if transport == "shm" else "elsewhere"
        async with caller:
            await caller.wait_ready(instance)
            view = caller.segment.view
            for i in range(batch):
                view[i * block : (i + 1) * block] = (i % 251).to_bytes(1, "little") * block
            keys = [i.to_bytes(16, "little") for i in range(count)]
            batches = [keys[i : i + batch] for i in range(0, count, batch)]
            slots_of = list(range(batch))
            warm = [(count + i).to_bytes(16, "little") for i in range(min(batch, slots))]  # maps segments, dials
            await caller.put(instance, warm, slots_of[: len(warm)])
            await caller.get(instance, warm, slots_of[: len(warm)])
            await caller.remove(instance, warm)
            t0 = time.perf_counter()
            for b in batches:
                assert await caller.put(instance, b, slots_of[: len(b)]) == len(b)
            put_s = time.perf_counter() - t0
            if disk:  # the DRAM-only tail goes, so every get below reads the disk tier and writes nothing back
                tail = keys[count - slots :]
                await caller.remove(instance, tail)
                keys, batches = keys[: count - slots], [keys[i : i + batch] for i in range(0, count - slots, batch)]
                dropped = drop_page_cache()
            else:
                dropped = None
            t0 = time.perf_counter()
            for b in batches:
                tiers = await caller.get(instance, b, slots_of[: len(b)])
                assert tiers == ["disk" if disk else "dram"] * len(b), tiers
            get_s = time.perf_counter() - t0
            last = min(1, batch - 1)
            assert caller.read(last) == (last % 251).to_bytes(1, "little") * block  # bit-exact
            result = {"put_s": put_s, "get_s": get_s, "blocks": len(keys), "put_blocks": count, "dropped": dropped}
            if disk:
                files = [directory / f"{k.hex()}.kvb" for k in keys]
                result["raw_s"] = raw_read(files, block + 64)
            return result
    finally:
        server.terminate()
        server.wait()


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def raw_read(files: list[Path], nbytes: int) -> float:
    """Seconds to read ``files`` one after another into one buffer, page cache dropped first."""
    drop_page_cache()
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            f.readinto(view)
    return time.perf_counter() - t0


# --- Mooncake client -----------------------------------------------------------------------------
def mooncake_run(block: int, count: int, batch: int) -> dict:
    import torch
    from mooncake.store import MooncakeDistributedStore

    holder = subprocess.Popen([sys.executable, __file__, "serve-mooncake", "--segment", str(count * block * 2 + 64 * MIB)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = holder.stdout.readline()
        assert line.startswith("ready 0"), line
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, batch * block + 16 * MIB, "tcp", "", f"127.0.0.1:{MASTER_PORT}")
        assert rc == 0, rc
        buffer = torch.zeros(batch * block, dtype=torch.uint8)
        for i in range(batch):
            buffer[i * block : (i + 1) * block] = i % 251
        assert store.register_buffer(buffer.data_ptr(), buffer.numel()) == 0
        ptrs = [buffer.data_ptr() + i * block for i in range(batch)]
        warm = [f"w{block}-{i}" for i in range(batch)]  # the first transfers connect and register: not timed
        store.batch_put_from(warm, ptrs, [block] * batch)
        store.batch_get_into(warm, ptrs, [block] * batch)
        store.batch_remove(warm) if hasattr(store, "batch_remove") else None
        keys = [f"k{block}-{i}" for i in range(count)]
        batches = [keys[i : i + batch] for i in range(0, count, batch)]
        t0 = time.perf_counter()
        for b in batches:
            if batch == 1:
                assert store.put_from(b[0], ptrs[0], block) == 0
            else:
                rcs = store.batch_put_from(b, ptrs[: len(b)], [block] * len(b))
                assert all(r == 0 for r in rcs), rcs
        put_s = time.perf_counter() - t0
        buffer.zero_()
        t0 = time.perf_counter()
        for b in batches:
            if batch == 1:
                assert store.get_into(b[0], ptrs[0], block) == block
            else:
                got = store.batch_get_into(b, ptrs[: len(b)], [block] * len(b))
                assert all(g == block for g in got), got
        get_s = time.perf_counter() - t0
        last = min(1, batch - 1)
        assert int(buffer[last * block]) == last % 251  # the bytes came back
        store.close()
        return {"put_s": put_s, "get_s": get_s, "blocks": count, "put_blocks": count}
    finally:
        holder.stdin.close()
        holder.wait(30)


# --- the run -------------------------------------------------------------------------------------
def plan(total_mib: int) -> list[tuple[int, int, int]]:
    """(block bytes, blocks, blocks per request)."""
    return [(4096, 4096, 1), (4096, 8192, 256), (MIB, total_mib, 32), (16 * MIB, total_mib // 16, 4)]


def main_run(args) -> None:
    from libs.common.nats_server import NatsServer

    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    master = subprocess.Popen([binary, "-rpc_address=127.0.0.1", f"-rpc_port={MASTER_PORT}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    nats = NatsServer().start()
    workdir = Path(tempfile.mkdtemp(prefix="kvserve-bench-store-", dir=args.dir))
    rows = []
    try:
        time.sleep(1.0)  # mooncake_master has no readiness signal; the first client setup retries anyway
        for block, count, batch in plan(args.total_mib):
            row = {"block": block, "count": count, "batch": batch}
            row["mooncake"] = mooncake_run(block, count, batch)
            for transport in ("shm", "tcp"):
                row[f"kvserve_{transport}"] = asyncio.run(kvserve_run(nats, block, count, batch, transport, False, workdir))
            if batch > 1:
                row["kvserve_disk"] = asyncio.run(kvserve_run(nats, block, count, batch, "shm", True, workdir))
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        nats.stop()
        master.terminate()
        master.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    report = render(rows, args)
    print(report)
    Path(args.out).write_text(report)


def render(rows: list[dict], args) -> str:
    def rate(r: dict, key: str, block: int) -> str:
        seconds = r[key]
        blocks = r["put_blocks"] if key == "put_s" else r["blocks"]
        if block < MIB:
            return f"{blocks / seconds / 1e3:,.1f}k ops/s"
        return f"{blocks * block / seconds / 1e9:.2f} GB/s"

    lines = [
        "# The store against Mooncake Store and the raw disk",
        "",
        f"`{' '.join(['.venv/bin/python', 'bench/store.py', *sys.argv[1:]])}` on "
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores; one client process (this one), each store its "
        "own process, all on loopback in a private network namespace. Page cache dropped before disk reads: "
        + ("yes (root)." if any(r.get("kvserve_disk", {}).get("dropped") for r in rows) else "no (not permitted)."),
        "",
        "| block | blocks × per request | Mooncake put | Mooncake get | kvserve put (shm) | kvserve get DRAM (shm) "
        "| kvserve put (tcp) | kvserve get DRAM (tcp) | kvserve get disk | raw sequential read |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["block"]
        size = f"{b // MIB} MiB" if b >= MIB else f"{b // 1024} KiB"
        m, s, t, d = r["mooncake"], r["kvserve_shm"], r["kvserve_tcp"], r.get("kvserve_disk")
        disk = rate(d, "get_s", b) if d else "—"
        raw = (f"{len(range(d['blocks'])) * b / d['raw_s'] / 1e9:.2f} GB/s" if b >= MIB else
               f"{d['blocks'] / d['raw_s'] / 1e3:,.1f}k files/s") if d else "—"  # fmt: skip
        lines.append(f"| {size} | {r['count']} × {r['batch']} | {rate(m, 'put_s', b)} | {rate(m, 'get_s', b)} | "
                     f"{rate(s, 'put_s', b)} | {rate(s, 'get_s', b)} | {rate(t, 'put_s', b)} | {rate(t, 'get_s', b)} | "
                     f"{disk} | {raw} |")  # fmt: skip
    lines += ["", "Raw numbers (seconds):", "", "```", *(json.dumps(r) for r in rows), "```", ""]
    return "\n".join(lines)


def in_private_netns() -> bool:
    """Set by the re-exec below (/sys/class/net would still show the host's interfaces)."""
    return os.environ.get("KVSERVE_BENCH_NETNS") == "1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd")
    k = sub.add_parser("serve-kvserve")
    for name in ("--nats", "--instance", "--dir"):
        k.add_argument(name, required=True)
    for name in ("--block-bytes", "--capacity", "--disk"):
        k.add_argument(name, type=int, required=True)
    m = sub.add_parser("serve-mooncake")
    m.add_argument("--segment", type=int, required=True)
    parser.add_argument("--total-mib", type=int, default=256, help="bytes per block size for 1 and 16 MiB blocks")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "store.md"))
    parser.add_argument("--dir", default=None, help="where the disk tier's files go (default: the system temp dir)")
    args = parser.parse_args()
    if args.cmd == "serve-kvserve":
        return serve_kvserve(args)
    if args.cmd == "serve-mooncake":
        return serve_mooncake(args)
    if not in_private_netns():
        inner = " ".join([sys.executable, __file__, *sys.argv[1:]])
        os.environ["KVSERVE_BENCH_NETNS"] = "1"
        os.execvp("unshare", ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {inner}"])
    main_run(args)


if __name__ == "__main__":
    main()
