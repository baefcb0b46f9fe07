"""Real store processes on a real nats-server, and a caller that speaks to them the
way a worker does: its own shared-memory segment and transfer engine, tickets,
two-phase puts. Used by the store's integration and reliability tests."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import nats

from libs.common.nats_flush import flush
from libs.common.settings import ModelSettings
from libs.common.store_client import StoreClient
from libs.protocol import schema, subjects
from libs.protocol.schema import CacheOwner, Heartbeat, KVContract, KVEventBatch, StoreStatsReply
from libs.transfer import Descriptor, SharedSegment, Span, TransferEngine
from libs.transfer.segment import new_segment_name
from tests.integration.conftest import poll_until

BLOCK_SIZE = 16


def store_contract() -> tuple[KVContract, int]:
    """The default model's contract in float32, as every test store computes it."""
    from services.store.__main__ import model_contract

    model = ModelSettings(model=None, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=1,
                          max_model_len=None)  # fmt: skip
    return model_contract(model)


class StoreProcess:
    """``python -m services.store`` with its output kept (and searchable)."""

    def __init__(self, instance_id: str, nats_url: str, directory: Path, slots: int, disk_blocks: int,
                 block_nbytes: int, failpoints: str = "", write_behind_s: float = 1.0) -> None:  # fmt: skip
        """``write_behind_s``: how long a committed block may wait for disk (the store's
        default); a test about eviction alone sets it far beyond its own length."""
        self.instance_id = instance_id
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", KVSERVE_NATS_URL=nats_url, KVSERVE_INSTANCE_ID=instance_id,
                        KVSERVE_DTYPE="float32", KVSERVE_BLOCK_SIZE=str(BLOCK_SIZE), KVSERVE_STORE_DIR=str(directory),
                        KVSERVE_STORE_CAPACITY_BYTES=str(slots * block_nbytes),
                        KVSERVE_STORE_DISK_BYTES=str(disk_blocks * (block_nbytes + 64)),
                        KVSERVE_STORE_WRITE_BEHIND_S=str(write_behind_s),
                        KVSERVE_HEARTBEAT_INTERVAL="0.2", KVSERVE_FAILPOINTS=failpoints)  # fmt: skip
        self.lines: deque[str] = deque(maxlen=2000)
        self.proc: subprocess.Popen | None = None

    def start(self, failpoints: str | None = None) -> "StoreProcess":
        if failpoints is not None:
            self.env["KVSERVE_FAILPOINTS"] = failpoints
        self.lines.clear()
        self.proc = subprocess.Popen([sys.executable, "-m", "services.store"], env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        return self

    def _pump(self) -> None:
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())

    def logged(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (a graceful stop), then its exit status."""
        self.proc.terminate()
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float = 60.0) -> int:
        self.proc.wait(timeout)
        self._reader.join(timeout)  # every line it wrote is in `lines`
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class Caller:
    """A worker's side of the store protocol, in the test process: `store` makes the
    calls, this moves the bytes (and fails the test on any error)."""

    def __init__(self, nats_url: str, contract: KVContract, block_nbytes: int, num_blocks: int = 64) -> None:
        self.nats_url = nats_url
        self.contract = contract
        self.block_nbytes = block_nbytes
        self.segment = SharedSegment.create(new_segment_name("caller", "kv"), num_blocks * block_nbytes)
        self.transfers = TransferEngine("test-host", listen="127.0.0.1:0")
        self.transfers.register(self.segment)
        self.nc = None
        self.store: StoreClient | None = None
        self.heartbeats: dict[str, Heartbeat] = {}
        self._beat = asyncio.Event()

    async def __aenter__(self) -> "Caller":
        self.nc = await nats.connect(self.nats_url)
        self.store = StoreClient(self.nc, self.contract, timeout=10.0)
        await self.nc.subscribe(subjects.heartbeats("store"), cb=self._on_heartbeat)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()
        self.transfers.close()

    async def _on_heartbeat(self, msg) -> None:
        beat = schema.decode(msg.data, Heartbeat)
        self.heartbeats[beat.instance_id] = beat
        self._beat.set()

    async def wait_ready(self, instance_id: str, started_after: float = 0.0, timeout: float = 60.0) -> None:
        """Until a heartbeat of ``instance_id`` that started after ``started_after`` (a time.time())."""
        deadline = time.monotonic() + timeout
        while True:
            beat = self.heartbeats.get(instance_id)
            if beat is not None and beat.started_at > started_after:
                return
            self._beat.clear()
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no heartbeat from {instance_id}"
            try:
                await asyncio.wait_for(self._beat.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def fill(self, slot: int, data: bytes) -> None:
        self.segment.view[slot * self.block_nbytes : (slot + 1) * self.block_nbytes] = data

    def read(self, slot: int) -> bytes:
        return bytes(self.segment.view[slot * self.block_nbytes : (slot + 1) * self.block_nbytes])

    async def put(self, instance_id: str, hashes: list[bytes], slots: list[int], pin: bool = False,
                  owner: CacheOwner | None = None) -> int:  # fmt: skip
        """Two-phase put of our ``slots`` under ``hashes`` (``owner``'s): how many the store
        did not have."""
        reply = await self.store.put(instance_id, hashes, self.block_nbytes, pin=pin, owner=owner)
        if not reply.missing:
            return 0
        spans = [Span(slots[i] * self.block_nbytes, o, self.block_nbytes) for i, o in zip(reply.missing, reply.offsets)]
        if len(spans) * self.block_nbytes <= 256 << 10:
            self._write(reply.ticket, spans)  # small: a thread hop costs more than the copy
        else:
            await asyncio.get_running_loop().run_in_executor(None, self._write, reply.ticket, spans)
        return await self.store.commit(instance_id, reply.put_id)

    def _write(self, ticket, spans) -> None:
        if self.transfers.choose_transport(ticket) == "shm":
            self.transfers.copy([Descriptor(self.segment.name, s.src_offset, ticket.segment, s.dst_offset, s.length)
                                 for s in spans])  # fmt: skip
            return
        writer = self.transfers.writer(ticket, self.segment.name)
        writer.submit(spans)
        writer.finish_sync()

    async def get(self, instance_id: str, hashes: list[bytes], slots: list[int]) -> list[str | None]:
        offsets = [s * self.block_nbytes for s in slots]
        ticket = self.transfers.expect(self.segment.name, [(o, self.block_nbytes) for o in offsets], 10.0)
        try:
            return await self.store.get(instance_id, hashes, self.block_nbytes, ticket, offsets)
        finally:
            self.transfers.close_ticket(ticket.token)

    async def exists(self, instance_id: str, hashes: list[bytes]) -> list[str | None]:
        return await self.store.exists(instance_id, hashes)

    async def remove(self, instance_id: str, hashes: list[bytes]) -> int:
        return await self.store.remove(instance_id, hashes)

    async def stats(self, instance_id: str) -> StoreStatsReply:
        return await self.store.stats(instance_id)

    async def wait_stats(self, instance_id: str, condition, timeout: float, what: str) -> StoreStatsReply:
        """Ask for a store's stats until ``condition(stats)`` holds; fail with ``what``
        after ``timeout`` seconds."""
        return await poll_until(lambda: self.stats(instance_id), condition, timeout, what)

    async def watch_disk(self, instance_id: str) -> set[bytes]:
        """The blocks a store's KV events say its disk tier holds, kept up to date from now
        on (events it published before are not in it)."""
        on_disk: set[bytes] = set()

        async def on_events(msg) -> None:
            for event in schema.decode(msg.data, KVEventBatch).events:
                if event.tier == "disk" and event.kind in ("stored", "demoted"):
                    on_disk.update(event.block_hashes)
                elif event.tier == "disk":
                    on_disk.difference_update(event.block_hashes)

        await self.nc.subscribe(subjects.kv_events(instance_id), cb=on_events)
        await flush(self.nc)  # subscribed at the server before the caller goes on
        return on_disk


def block_bytes(i: int, nbytes: int) -> bytes:
    """Distinct, reproducible contents for block ``i``."""
    import hashlib

    seed = hashlib.blake2b(i.to_bytes(4, "little"), digest_size=64).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def block_hash(i: int) -> bytes:
    import hashlib

    return hashlib.blake2b(b"block" + i.to_bytes(4, "little"), digest_size=16).digest()
