"""A service gives freed heap memory back to the kernel, and keeps what it built at
start-up out of the garbage collector's full passes (libs/common/heap.py)."""

import asyncio
import gc

import nats
import pytest

from libs.common import heap
from libs.common.nats_flush import flush
from libs.common.nats_server import NatsServer
from libs.common.service import Service
from libs.common.settings import ServiceSettings, service_env
from libs.protocol import subjects

WAIT = 30.0  # seconds a start may take at most


@pytest.mark.skipif(not heap.can_trim(), reason="the C library has no malloc_trim (not glibc)")
def test_trimming_returns_freed_heap_memory_to_the_kernel():
    def rss_kb() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

    heap.trim()  # from a trimmed heap
    # many small blocks (below the mmap threshold, so on the heap), then all freed but the
    # last: glibc keeps the freed ones for reuse below that survivor until trimmed
    blocks = [bytearray(64 * 1024) for _ in range(3000)]
    survivor = blocks[-1]
    del blocks
    held = rss_kb()
    assert heap.trim()
    assert rss_kb() < held - 100 * 1024  # more than 100 MiB of the ~190 MiB freed went back
    assert len(survivor) == 64 * 1024


def test_the_trim_interval_is_a_service_setting(monkeypatch):
    monkeypatch.setenv("KVSERVE_HEAP_TRIM_S", "0")
    assert service_env("gateway")["heap_trim_s"] == 0
    monkeypatch.delenv("KVSERVE_HEAP_TRIM_S")
    assert service_env("gateway")["heap_trim_s"] == 60
    monkeypatch.setenv("KVSERVE_HEAP_TRIM_S", "-1")
    with pytest.raises(ValueError, match="KVSERVE_HEAP_TRIM_S"):
        service_env("gateway")


def collected(obj: object) -> bool:
    """Whether the cyclic GC's passes walk ``obj`` (False once ``gc.freeze()`` has moved it)."""
    return any(o is obj for o in gc.get_objects())


class Building(Service):
    """A service that builds something at start-up, as a worker loads its model."""

    async def start(self, stack) -> None:
        self.built = {"model": [object() for _ in range(3)]}


def test_freezing_leaves_what_exists_out_of_later_passes_and_garbage_is_still_collected():
    kept = {"weights": [1, 2, 3]}
    assert collected(kept)
    try:
        assert heap.freeze() >= 1
        assert not collected(kept) and gc.is_tracked(kept)
        later = {"request": []}
        assert collected(later)  # what comes after is collected as before
    finally:
        gc.unfreeze()


def test_a_started_service_has_frozen_what_its_start_built():
    async def scenario():
        with NatsServer() as server:
            watcher = await nats.connect(server.url)
            roll_calls = await watcher.subscribe(subjects.ROLL_CALL)
            await flush(watcher)
            service = Building(ServiceSettings(role="store", nats_url=server.url, instance_id="store-g", host_id="h"))
            running = asyncio.create_task(service.run())
            try:
                await asyncio.wait_for(roll_calls.next_msg(timeout=WAIT), WAIT)  # its call: started
                return not collected(service.built) and not collected(service.built["model"])
            finally:
                service.stopping.set()
                await asyncio.wait_for(running, WAIT)
                await watcher.close()

    try:
        assert asyncio.run(scenario())
    finally:
        gc.unfreeze()
