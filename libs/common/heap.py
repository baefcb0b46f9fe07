"""Giving freed heap memory back to the system, and keeping the start-up heap out of
the garbage collector's way.

glibc keeps memory a process freed in its arenas (one per thread that allocates) for
reuse, and returns it to the kernel only from the top of each heap, so a worker whose
engine, transfer and event-loop threads allocate and free tensors and buffers of many
sizes holds far more resident memory than it uses. Each service therefore trims its
heap every ``KVSERVE_HEAP_TRIM_S`` seconds (60 by default; 0 turns it off), on a
thread, off its event loop. In the 30-minute soak the prefill worker's RSS at its warm
snapshot fell from 1,837 MB to 1,493 MB with it (bench/results/soak.md, two runs of
the same day); its slow growth after warm-up remained, so that growth is not memory
the allocator merely kept.

Python's cyclic garbage collector now and then walks every object it tracks (a full,
generation-2 pass), holding the GIL throughout: 127 ms in a worker that has imported
torch and transformers (286,000 objects), ~50 ms in a conductor whose KV index holds a
million blocks, on this project's 2-core reference machine. Such a pass lands inside a
decode step or an admission. What a service builds at start-up lives as long as the
process, so each service freezes it (``freeze``: ``gc.freeze()``, as vLLM's engine does
after loading its model) once it has started, and the conductor again once it has read
the KV history; later passes walk only what came after.
"""

import atexit
import ctypes
import ctypes.util
import gc
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


def freeze() -> int:
    """Collect what is garbage now, then move every object left into the collector's
    permanent generation, which its passes skip; returns how many objects that holds.
    Blocking (a full pass: ~50-130 ms on a large heap): call it at start-up, not per request."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


atexit.register(gc.unfreeze)  # at exit the collector gets frozen objects back: finalization frees them as before
