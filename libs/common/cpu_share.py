"""A worker's share of its host's cores: which cores it runs on (KVSERVE_CPUS), how
many torch threads it computes with (KVSERVE_THREADS) and whether it computes at low
priority beside another worker (KVSERVE_LOW_PRIORITY), applied by the process itself
before it loads the model, so the engine and its calibration see only that share.

Core lists are written as Linux writes them (``/proc/<pid>/status``, ``taskset -c``):
``0-3,6``. Nothing here imports torch until the share is applied.
"""

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> ``(0, 1, 2, 3, 6)``, sorted, each core once; ValueError on anything else."""
    cpus: set[int] = set()
    for item in text.split(","):
        first, dash, last = item.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"{text!r} is not a core list like 0-3,6") from None
        if low < 0 or high < low:
            raise ValueError(f"{item.strip()!r} in {text!r} is not a core or an ascending range of cores")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...] | list[int] | set[int]) -> str:
    """``(0, 1, 2, 3, 6)`` -> ``"0-3,6"``: the inverse of parse_cpu_list."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def apply_cpu_share(cpus: tuple[int, ...] | None, threads: int | None) -> tuple[tuple[int, ...], int]:
    """Pin every thread of this process to ``cpus`` (None: leave the affinity alone) and
    give torch ``threads`` intra-op threads (None: one per core of ``cpus``, or torch's
    own choice, from OMP_NUM_THREADS, when no cores are given). Returns the cores and the
    thread count now in effect."""
    if cpus is not None:
        # sched_setaffinity(0) moves the calling thread only: move every thread already
        # started (threads started later inherit the affinity of the one starting them).
        for task in Path("/proc/self/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except ProcessLookupError:
                pass  # that thread ended meanwhile
    import torch

    if threads is None and cpus is not None:
        threads = len(cpus)
    if threads is not None:
        torch.set_num_threads(threads)
    return available_cpus(), torch.get_num_threads()


# Linux's CFS/EEVDF weights: nice 0 weighs 1024, nice 5 weighs 335 (kernel/sched/core.c).
LOW_PRIORITY_NICE = 5
LOW_PRIORITY_SHARE = 335 / (335 + 1024)  # of a core a busy nice-0 thread also wants: 24.7%


def compute_at_low_priority() -> None:
    """The calling thread, and every thread it starts from now on (torch's OpenMP team),
    computes at nice LOW_PRIORITY_NICE: on a core a busy thread of normal priority also
    wants, it gets LOW_PRIORITY_SHARE of the time, and all of the time the other leaves.
    A worker's engine thread calls it; the threads that serve its messages and move its
    KV keep their priority within the process.

    Where the kernel groups threads by session (autogroups, on by default on most
    distributions' kernels), it first shares a core among sessions by their own nice,
    then among a session's threads: each kvserve service is a session of its own, so a
    thread's nice alone would still take half of a busy decode worker's core (it was
    measured so: the decode worker's calibration ran at half speed). So the process's
    session gets the same nice, where the process leads a session of its own (as `kvserve
    up` starts each service): never a shell's session that other processes share."""
    os.setpriority(os.PRIO_PROCESS, 0, LOW_PRIORITY_NICE)  # 0: the calling thread (Linux: nice is per thread)
    if os.getsid(0) != os.getpid():
        return
    try:
        AUTOGROUP.write_text(str(LOW_PRIORITY_NICE))
    except OSError:
        pass  # no autogroups here (the kernel's or the container's choice): the thread's nice does it alone


AUTOGROUP = Path("/proc/self/autogroup")
