"""How a local cluster shares its host's cores: ``kvserve up --cpus`` parsed, and the
plan that gives each worker its cores and torch threads.

Each worker applies its share itself at start (libs/common/cpu_share.py, from
KVSERVE_CPUS and KVSERVE_THREADS), before it loads and calibrates its model. The
gateway, conductor and store move bytes, not tensors: one torch thread each, unpinned.
OpenMP threads spin briefly and then sleep (GOMP_SPINCOUNT=1000, ~0.1 ms): a worker
waiting for work leaves its cores to the others within a fraction of a millisecond,
while the matmuls of one decode step, microseconds apart, still find their team awake
(sleeping at once, OMP_WAIT_POLICY=PASSIVE, made every matmul wake its team: a
two-thread batch-1 step took twice as long; bench/results/omp_wait.md).
"""

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace

from libs.common.cpu_share import format_cpu_list, parse_cpu_list
from libs.protocol.vocabulary import Role

WORKER_ROLES = (Role.PREFILL, Role.DECODE)  # also the order cores are handed out in
SPINCOUNT = "1000"  # libgomp's spins before an idle OpenMP thread sleeps (torch ships libgomp)


@dataclass(frozen=True)
class CpuShare:
    cpus: tuple[int, ...] | None  # the cores it may run on; None: not pinned
    threads: int  # torch intra-op threads
    low_priority: bool = False  # its engine thread yields most of a busy core to the decode worker beside it

    def env(self) -> dict[str, str]:
        """The variables a process is started with to take this share."""
        env = {"KVSERVE_THREADS": str(self.threads), "OMP_NUM_THREADS": str(self.threads), "GOMP_SPINCOUNT": SPINCOUNT}
        if self.cpus is not None:
            env["KVSERVE_CPUS"] = format_cpu_list(self.cpus)
        if self.low_priority:
            env["KVSERVE_LOW_PRIORITY"] = "1"
        return env

    def describe(self) -> str:
        where = "any core" if self.cpus is None else f"cores {format_cpu_list(self.cpus)}"
        low = " at low priority" if self.low_priority else ""
        return f"{where}, {self.threads} thread{'s' if self.threads != 1 else ''}{low}"


IO_SHARE = CpuShare(cpus=None, threads=1)  # the gateway, the conductor, the store


def parse_cpus_option(text: str, host: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """``prefill=0-3,decode=4-7`` (or ``prefill=0,2,decode=1``: an item without ``=``
    continues the role before it) -> cores by worker role, each a subset of ``host``.
    Raises ValueError saying what is wrong."""
    lists: dict[str, list[str]] = {}
    role = None
    for item in text.split(","):
        name, eq, cores = item.partition("=")
        if eq:
            role = name.strip()
            if role not in WORKER_ROLES:
                raise ValueError(f"{role!r} is not a worker role: give cores to {' and '.join(WORKER_ROLES)}")
            if role in lists:
                raise ValueError(f"{role} is given cores twice")
            lists[role] = [cores]
        elif role is None:
            raise ValueError(f"{text!r}: start with a role, e.g. prefill=0-3,decode=4-7")
        else:
            lists[role].append(item)
    roles = {}
    for role, items in lists.items():
        cores = parse_cpu_list(",".join(items))
        if missing := set(cores) - set(host):
            raise ValueError(f"{role}: no core {format_cpu_list(missing)} here (this process may run on "
                             f"{format_cpu_list(host)})")  # fmt: skip
        roles[role] = cores
    return roles


def divide(cores: Sequence[int], workers: Sequence[str]) -> dict[str, CpuShare]:
    """Share ``cores`` among ``workers``: with at least one core each, disjoint runs of
    cores in order, as even as they go (the first workers get one more when uneven);
    with fewer cores than workers, every worker may run on every core, with
    ``max(1, cores // workers)`` threads (sleeping soon after they go idle)."""
    cores = sorted(cores)
    if len(cores) < len(workers):
        shared = CpuShare(tuple(cores), max(1, len(cores) // len(workers)))
        return {worker: shared for worker in workers}
    each, extra = divmod(len(cores), len(workers))
    plan, start = {}, 0
    for i, worker in enumerate(workers):
        size = each + (i < extra)
        plan[worker] = CpuShare(tuple(cores[start : start + size]), size)
        start += size
    return plan


def plan_cpus(
    counts: dict[str, int],
    host: Sequence[int],
    explicit: dict[str, tuple[int, ...]] | None = None,
    shared_prefill: int = 0,
) -> dict[str, CpuShare]:
    """Every instance's share, by instance id (``prefill-0``), for ``counts`` instances
    of each role on a host whose cores are ``host``. Without ``explicit`` the workers
    divide the host (prefill first, so it gets the larger share when uneven); a role
    in ``explicit`` divides its own cores among its workers, and a role left out
    divides the host's cores no named role took (all of them if none is left). A
    role with no instance takes no share: with no prefill worker (a colocated
    cluster), the decode workers divide every core. The last ``shared_prefill`` of the
    prefill workers take no cores of their own: they divide the decode workers', and
    compute there at low priority (libs/common/cpu_share.py): while the decode worker
    steps they get a quarter of the core, and all of the time decoding leaves; each
    reports its speed as at least that quarter's, so the conductor never counts on more
    (bench/results/shared-prefill.md). Workers that share cores because there are more
    workers than cores (every one on every core) keep their priority.
    Raises ValueError when ``explicit`` gives cores to a role with no instance."""
    plan = {f"{role}-{i}": IO_SHARE for role, n in counts.items() if role not in WORKER_ROLES for i in range(n)}
    workers = {role: [f"{role}-{i}" for i in range(counts.get(role, 0))] for role in WORKER_ROLES}
    if not 0 <= shared_prefill <= len(workers[Role.PREFILL]):
        raise ValueError(f"{shared_prefill} shared prefill workers of {len(workers[Role.PREFILL])}")
    own = len(workers[Role.PREFILL]) - shared_prefill  # prefill workers with cores of their own
    workers[Role.PREFILL], shared = workers[Role.PREFILL][:own], workers[Role.PREFILL][own:]
    explicit = explicit or {}
    if idle := [role for role in explicit if not workers[role]]:
        raise ValueError(f"cores are given to {idle[0]}, but the cluster runs no {idle[0]} worker")
    rest = sorted(set(host) - {core for cores in explicit.values() for core in cores}) or sorted(host)
    unnamed = [worker for role in WORKER_ROLES if role not in explicit for worker in workers[role]]
    if unnamed:
        plan |= divide(rest, unnamed)
    for role, cores in explicit.items():
        plan |= divide(cores, workers[role])
    decoding = {core for worker in workers[Role.DECODE] for core in plan[worker].cpus or ()}
    if shared:
        plan |= {worker: replace(share, low_priority=True)
                 for worker, share in divide(sorted(decoding or host), shared).items()}  # fmt: skip
    return plan


def default_shared_prefill(prefill: int, decode: int, host: Sequence[int]) -> int:
    """How many prefill workers `kvserve up` adds on the decode workers' cores: one, beside
    at least one prefill and one decode worker with cores of their own (on 2 cores: 1-3%
    more goodput at equal loads, capacity 3.37 against 2.83 requests/s, every promise
    kept: bench/results/shared-prefill.md); none where the workers already share cores."""
    return int(prefill >= 1 and decode >= 1 and len(host) >= prefill + decode)


def cpus_argument(host: Sequence[int]):
    """An argparse ``type`` for ``--cpus``: a bad spec exits 2 with one line saying why."""

    def parse(text: str) -> dict[str, tuple[int, ...]]:
        try:
            return parse_cpus_option(text, host)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse
