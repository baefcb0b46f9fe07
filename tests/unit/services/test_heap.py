"""A service gives freed heap memory back to the kernel (libs/common/heap.py)."""

import pytest

from libs.common import heap
from libs.common.settings import service_env


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
