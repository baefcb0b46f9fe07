"""The transfer engine against this machine's memory and sockets, side by side in one run.

For each size: our shm path against a torch ``copy_`` between two preallocated,
touched tensors; our TCP path (1, 4 and 8 connections, 4 MiB slices) against a
bare blocking socket (one connection, ``sendall`` / ``recv_into``); Mooncake's
Transfer Engine over TCP where it installs; our TCP path with mutual TLS (1 and 4
connections, a throwaway CA; the TLS session agrees the keys of sealed records) beside
the same path in clear, and the bare socket with TLS throughout (what Python's ssl module
costs by itself); then, for each size from 4 MiB, TCP in clear and with TLS alone, side by
side, one transfer each back to back for hundreds of pairs, with warm caches and with the
caches evicted before every transfer (the figure TLS's target is judged on). Receivers
live in other processes (bench/transfer_peer.py); the shm path is also run with the
receiver in this process. Then the KV hand-off of a 2,048-token prompt (bench/transfer_handoff.py).
Repetitions alternate between the contenders so machine noise hits all of them;
every contender's bytes are checked once per size, outside the timed region.

Mooncake's listeners bind every interface, so when it is installed the bench
re-runs itself inside ``unshare -n`` (a network namespace holding only ``lo``)
and skips Mooncake, saying why, where that is not allowed.

    python bench/transfer.py [--sizes 64K 256K 1M 4M 16M 64M 256M] [--reps 5] [--out bench/results/transfer.md]
"""

import argparse
import asyncio
import datetime
import hashlib
import importlib.util
import json
import os
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import msgspec
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.transfer_costs import fixed_costs  # noqa: E402
from bench.transfer_handoff import HandoffBench, kv_bytes  # noqa: E402
from bench.transfer_report import TARGET_FROM, machine_load, report, write_report  # noqa: E402
from libs.common.certificates import ClusterCA  # noqa: E402
from libs.common.tls import mutual_context  # noqa: E402
from libs.protocol.schema import WriteTicket  # noqa: E402
from libs.transfer import SharedSegment, Span, TransferEngine  # noqa: E402
from libs.transfer.segment import SHM_DIR, new_segment_name  # noqa: E402

PEER = ROOT / "bench" / "transfer_peer.py"
NETNS_ENV = "KVSERVE_BENCH_NETNS"
DEFAULT_SIZES = "64K 256K 1M 4M 16M 64M 256M"
LENGTH = struct.Struct("<Q")
SLICE = 4 << 20
FLUSH_BYTES = 64 << 20  # copied before each transfer of a cold TLS pair: more than this machine's caches
PAIRS_SECONDS = 2.0  # about how long each size and condition of the TLS pairs takes, by default
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def transfers_per_rep(n: int) -> int:
    """Small transfers are timed in runs of several back to back (each with its own ticket)."""
    return max(1, min(16, (4 << 20) // n))


def digest(view) -> str:
    return hashlib.blake2b(view, digest_size=16).hexdigest()


class PeerError(RuntimeError):
    pass


class Peer:
    """A transfer_peer.py process: one JSON line per command; it exits when its stdin closes."""

    def __init__(self, logdir: Path, mode: str, *args) -> None:
        self.mode = mode
        self.log_path = logdir / f"{mode}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(PEER), mode, *map(str, args)], cwd=ROOT, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)  # fmt: skip
        self.hello = self._read(timeout=120)

    def ask(self, *words, timeout: float = 300) -> dict:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:  # skip anything a library printed to stdout: answers are JSON objects
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                tail = self.log_path.read_text()[-1500:]
                raise PeerError(f"{self.mode} peer {'gave no answer' if not ready else 'exited'}; its log ends:\n{tail}")
            if line.startswith("{"):
                message = json.loads(line)
                if "error" in message:
                    raise PeerError(f"{self.mode} peer: {message['error']}")
                return message

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class WireBench:
    """Every contender for raw bytes, sharing one random source buffer."""

    def __init__(self, stack: ExitStack, logdir: Path, max_size: int, room: int, mooncake: bool, pids: list[int]) -> None:
        self.pids = pids  # every process that may leave a segment behind
        self.peer = self._peer(stack, logdir, "kvserve", max(max_size, room))
        ca = ClusterCA.create("bench-ca")
        receiver_tls = ca.issue("receiver").write(logdir / "tls-receiver")
        self.tls_peer = self._peer(stack, logdir, "kvserve-tls", max_size, receiver_tls.cert, receiver_tls.key,
                                   receiver_tls.ca)  # fmt: skip
        self.socket_peer = self._peer(stack, logdir, "socket", max_size)
        self.socket_tls_peer = self._peer(stack, logdir, "socket-tls", max_size, receiver_tls.cert, receiver_tls.key,
                                          receiver_tls.ca)  # fmt: skip
        self.source = self._segment(stack, "src", max_size)
        torch.manual_seed(0)
        self.source.tensor.random_(0, 256)
        self.local_destination = self._segment(stack, "rx", max_size)
        self.local = self._engine(stack, TransferEngine("bench-host"))
        self.local.register(self.local_destination)
        self.engines = {"shm": self._engine(stack, TransferEngine("bench-host", transport="shm"))}
        for c in (1, 4, 8):
            self.engines[f"tcp{c}"] = self._engine(stack, TransferEngine("bench-host", transport="tcp", connections=c,
                                                                         slice_bytes=SLICE))  # fmt: skip
        sender_tls = ca.issue("sender").write(logdir / "tls-sender")
        for c in (1, 4):
            self.engines[f"tls{c}"] = self._engine(stack, TransferEngine("bench-host", transport="tcp", connections=c,
                                                                         slice_bytes=SLICE, tls=sender_tls))  # fmt: skip
        for engine in self.engines.values():
            engine.register(self.source)
        self.memcpy_src = torch.ones(max_size, dtype=torch.uint8)
        self.memcpy_dst = torch.zeros(max_size, dtype=torch.uint8)  # zeros writes every page: touched
        host, port = self.socket_peer.hello["address"].rsplit(":", 1)
        self.sock = stack.enter_context(socket.create_connection((host, int(port))))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        host, port = self.socket_tls_peer.hello["address"].rsplit(":", 1)
        plain = socket.create_connection((host, int(port)))
        plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tls_sock = stack.enter_context(mutual_context(sender_tls, server=False).wrap_socket(plain))
        self.mooncake_late: list[int] = []  # sizes whose sync write returned before the bytes were there
        self.mooncake_rx = self.mooncake_tx = None
        if mooncake:
            self.mooncake_rx = self._peer(stack, logdir, "mooncake-rx", max_size)
            rx = self.mooncake_rx.hello
            self.mooncake_tx = self._peer(stack, logdir, "mooncake-tx", max_size, rx["session"], rx["buffer"])
        self._hashes: dict[int, str] = {}

    def _peer(self, stack: ExitStack, logdir: Path, mode: str, *args) -> Peer:
        peer = Peer(logdir, mode, *args)
        stack.callback(peer.close)
        self.pids.append(peer.proc.pid)
        return peer

    def _segment(self, stack: ExitStack, purpose: str, nbytes: int) -> SharedSegment:
        segment = SharedSegment.create(new_segment_name("bench", purpose), nbytes)
        stack.callback(segment.close)
        return segment

    def _engine(self, stack: ExitStack, engine: TransferEngine) -> TransferEngine:
        stack.callback(engine.close)
        return engine

    def contenders(self) -> list[str]:
        names = ["memcpy", "memcpy-1t", "shm", "shm-local", "socket", "socket-tls", "tcp1", "tcp4", "tcp8", "tls1",
                 "tls4"]  # fmt: skip
        return names + (["mooncake", "mooncake-batch"] if self.mooncake_tx is not None else [])

    def source_hash(self, n: int) -> str:
        if n not in self._hashes:
            self._hashes[n] = digest(self.source.view[:n])
        return self._hashes[n]

    # --- one timed run of k transfers of n bytes: seconds --------------------------
    async def run(self, name: str, n: int, k: int) -> float:
        if name.startswith("memcpy"):
            src, dst = self.memcpy_src[:n], self.memcpy_dst[:n]
            threads = torch.get_num_threads()
            if name == "memcpy-1t":
                torch.set_num_threads(1)
            try:
                start = time.perf_counter()
                for _ in range(k):
                    dst.copy_(src)
                return time.perf_counter() - start
            finally:
                torch.set_num_threads(threads)
        if name in ("socket", "socket-tls"):
            view, sock = self.source.view[:n], self.sock if name == "socket" else self.tls_sock
            start = time.perf_counter()
            for _ in range(k):
                sock.sendall(LENGTH.pack(n))
                sock.sendall(view)
                if sock.recv(1) != b"\x01":
                    raise PeerError("the socket peer did not acknowledge")
            return time.perf_counter() - start
        if name.startswith("mooncake"):
            if name == "mooncake":
                return self.mooncake_tx.ask("write", n, k)["seconds"]
            return self.mooncake_tx.ask("batch", n, SLICE, k)["seconds"]
        if name == "shm-local":
            tickets = [self.local.expect(self.local_destination.name, [(0, n)], ttl=600) for _ in range(k)]
            engine = self.engines["shm"]
        else:
            peer = self.tls_peer if name.startswith("tls") else self.peer
            tickets = [msgspec.convert(t, WriteTicket) for t in peer.ask("tickets", k)["tickets"]]
            engine = self.engines[name]
        start = time.perf_counter()
        for ticket in tickets:
            await engine.write(ticket, self.source.name, [Span(0, 0, n)])
        elapsed = time.perf_counter() - start
        if name == "shm-local":
            for ticket in tickets:
                self.local.close_ticket(ticket.token)
        return elapsed

    async def check(self, name: str, n: int) -> None:
        """One untimed transfer into a zeroed destination; raise unless the bytes arrived."""
        if name.startswith("memcpy"):
            self.memcpy_dst[:n].zero_()
            await self.run(name, n, 1)
            assert torch.equal(self.memcpy_dst[:n], self.memcpy_src[:n])
            return
        if name.startswith("mooncake"):
            self.mooncake_rx.ask("zero", n)
            await self.run(name, n, 1)
            expected = self.mooncake_tx.ask("hash", 0, n)["hash"]
            arrived = self.mooncake_rx.ask("hash", 0, n)["hash"]
            if arrived != expected:  # its sync write may return before the target has the bytes
                self.mooncake_late.append(n)
                time.sleep(1.0)
                arrived = self.mooncake_rx.ask("hash", 0, n)["hash"]
        else:
            peer = {"socket": self.socket_peer, "socket-tls": self.socket_tls_peer, "tls1": self.tls_peer,
                    "tls4": self.tls_peer}.get(name, self.peer)  # fmt: skip
            if name == "shm-local":
                self.local_destination.tensor[:n].zero_()
            else:
                peer.ask("zero", n)
            await self.run(name, n, 1)
            expected = self.source_hash(n)
            arrived = digest(self.local_destination.view[:n]) if name == "shm-local" else peer.ask("hash", 0, n)["hash"]
        if arrived != expected:
            raise RuntimeError(f"{name}: {n} bytes did not arrive intact")

    async def measure(self, sizes: list[int], reps: int) -> dict[int, dict[str, list[float]]]:
        """Seconds per transfer, every repetition, per size and contender."""
        results = {}
        names = self.contenders()
        for n in sizes:
            k = transfers_per_rep(n)
            for name in names:
                await self.check(name, n)
            samples: dict[str, list[float]] = {name: [] for name in names}
            for rep in range(reps):
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    samples[name].append(await self.run(name, n, k) / k)
            results[n] = samples
            print(f"  {n >> 10:>7} KiB: " + ", ".join(f"{name} {n / statistics.median(s) / 1e9:.2f}"
                                                    for name, s in samples.items()) + " GB/s", flush=True)  # fmt: skip
        return results

    async def tls_pairs(self, n: int, pairs: int, cold: bool) -> list[tuple[float, float]]:
        """Seconds of (clear, TLS) transfers over 4 connections, ``pairs`` times back to back,
        which goes first alternating; ``cold``: caches flushed before each transfer."""
        flush = None
        if cold:
            flush = (torch.ones(FLUSH_BYTES, dtype=torch.uint8), torch.zeros(FLUSH_BYTES, dtype=torch.uint8))
        result = []
        for i in range(pairs):
            times = {}
            for name in ("tcp4", "tls4") if i % 2 else ("tls4", "tcp4"):
                if flush is not None:
                    flush[1].copy_(flush[0])
                times[name] = await self.run(name, n, 1)
            result.append((times["tcp4"], times["tls4"]))
        return result


def mooncake_availability() -> tuple[bool, str]:
    """Whether Mooncake can run here, and if not, why not."""
    if importlib.util.find_spec("mooncake") is None:
        return False, "not installed (`pip install mooncake-transfer-engine-non-cuda`; needs libibverbs1, libnl-route-3-200)"
    interfaces = [name for _, name in socket.if_nameindex()]
    if interfaces != ["lo"]:
        return False, f"not in a private network namespace (interfaces {interfaces}); its listeners bind all interfaces"
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        return False, f"does not import: {e}"
    return True, ""


def reexec_in_private_netns() -> None:
    """Run this bench again inside ``unshare -n`` with ``lo`` up, if allowed; return if not."""
    if os.environ.get(NETNS_ENV) or importlib.util.find_spec("mooncake") is None:
        return
    if [name for _, name in socket.if_nameindex()] == ["lo"]:
        return
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True)
    if probe.returncode != 0:
        return
    os.environ[NETNS_ENV] = "1"
    script = 'ip link set lo up && exec "$0" "$@"'
    os.execvp("unshare", ["unshare", "-n", "sh", "-c", script, sys.executable, *sys.argv])


def remove_our_segments(pids: list[int]) -> None:
    """Unlink any segment this bench or its peers created and did not remove (a killed peer)."""
    for pid in pids:
        for path in SHM_DIR.glob(f"kvserve-{pid}-*"):
            path.unlink(missing_ok=True)


async def bench(args, stack: ExitStack, logdir: Path, pids: list[int]) -> dict:
    from libs.engine.model.loader import load_model

    mooncake, why_not = mooncake_availability()
    if args.no_mooncake:
        mooncake, why_not = False, "skipped (--no-mooncake)"
    print(f"mooncake: {'yes' if mooncake else why_not}", flush=True)
    dtypes = [d for d in args.dtypes.split(",") if d] if not args.no_handoff else []
    loaded = {d: load_model(None, dtype=d, progress=False) for d in dtypes}
    room = max((kv_bytes(m) for m in loaded.values()), default=0)
    wire = WireBench(stack, logdir, max(args.sizes), room, mooncake, pids)
    result = {"wire": await wire.measure(args.sizes, args.reps), "mooncake": why_not or "ran",
              "mooncake_late": wire.mooncake_late, "handoff": [], "tls_pairs": [],
              "flush_bytes": FLUSH_BYTES}  # fmt: skip
    for n in (n for n in args.sizes if n >= TARGET_FROM):
        s = result["wire"][n]
        pairs = args.tls_pairs or max(40, min(1000, int(PAIRS_SECONDS / (statistics.median(s["tcp4"])
                                                                          + statistics.median(s["tls4"])))))  # fmt: skip
        for cold in (False, True):
            samples = await wire.tls_pairs(n, pairs, cold)
            result["tls_pairs"].append({"size": n, "cold": cold, "pairs": samples})
            print(f"  TLS pairs {n >> 20} MiB {'cold' if cold else 'warm'}: {pairs} pairs, median cost "
                  f"{statistics.median(1 - c / t for c, t in samples) * 100:.0f}%", flush=True)  # fmt: skip
    result["costs"] = await fixed_costs(wire.peer, wire.source)
    for dtype, model in loaded.items():
        for chunk in args.chunks:
            print(f"  hand-off {dtype}, max_chunk_tokens {chunk}", flush=True)
            handoff = HandoffBench(model, chunk, wire.peer)
            try:
                samples = await handoff.run(args.handoff_reps, lambda line: print(line, flush=True))
            finally:
                handoff.close()
            result["handoff"].append({"dtype": dtype, "chunk": chunk, "kv_bytes": kv_bytes(model), "samples": samples})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES.split(), help="e.g. 64K 1M 256M")
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--tls-pairs", type=int, default=0,
                        help="clear and TLS transfers side by side, per size >= 4 MiB and condition (default: ~2 s)")
    parser.add_argument("--handoff-reps", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="hand-off dtypes, comma-separated")
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 512], help="hand-off max_chunk_tokens")
    parser.add_argument("--no-handoff", action="store_true")
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument("--out", default="bench/results/transfer.md")
    args = parser.parse_args()
    args.sizes = sorted({parse_size(s) for text in args.sizes for s in text.split(",") if s})
    if not args.no_mooncake:
        reexec_in_private_netns()
    command = " ".join(["python bench/transfer.py", *sys.argv[1:]])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind (and clean up) as on Ctrl-C
    torch.set_grad_enabled(False)
    before, started = machine_load(), datetime.datetime.now()
    pids: list[int] = [os.getpid()]
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as logdir:
        try:
            with ExitStack() as stack:
                result = asyncio.run(bench(args, stack, Path(logdir), pids))
        except KeyboardInterrupt:
            raise SystemExit("interrupted: peers stopped, segments removed, nothing written")
        finally:
            remove_our_segments(pids)
    text = report(result, command, started, before, machine_load())
    write_report(Path(args.out), text)
    print(text)


if __name__ == "__main__":
    main()
