"""Giving freed heap memory back to the system.

glibc keeps memory a process freed in its arenas (one per thread that allocates) for
reuse, and returns it to the kernel only from the top of each heap, so a worker whose
engine, transfer and event-loop threads allocate and free tensors and buffers of many
sizes holds far more resident memory than it uses. Each service therefore trims its
heap every ``KVSERVE_HEAP_TRIM_S`` seconds (60 by default; 0 turns it off), on a
thread, off its event loop. In the 30-minute soak the prefill worker's RSS at its warm
snapshot fell from 1,837 MB to 1,493 MB with it (bench/results/soak.md, two runs of
the same day); its slow growth after warm-up remained, so that growth is not memory
the allocator merely kept.
"""

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def _libc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None


_trim = _libc_trim()


def can_trim() -> bool:
    return _trim is not None


def trim() -> bool:
    """Return freed heap memory to the kernel (blocking: milliseconds on a large heap).
    True when some was returned; False where there was none or the C library cannot."""
    return bool(_trim(0)) if _trim is not None else False
